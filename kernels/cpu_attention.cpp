// Paged decode attention for CPUs: one query token per sequence over its cached tokens, read
// in place from the pages (no gather), K and V each read once for all query heads of a KV
// head. Built and loaded by cpu_build.py, called by cpu_attention.py. Where the build has
// vectors (AVX-512 or AVX2: cpu_vector.h), the common shapes (head size 64 or 128, 1-8 queries
// per KV head) take a path that sums a vector's worth of tokens' dot products at once and
// keeps each head group in registers. On AVX-512 (issue 31): 64 sequences of 100-640 tokens,
// cache resident, 4.8x faster than the plain loop below (4.9 -> 1.0 ms fp32, 2.5 -> 1.1 ms
// bf16, one thread); from DRAM, the prefetches spread over the reads (`prefetch_ahead`) make it
// 1.3x faster again: the same 64 sequences among 2 GiB of pages, bf16, 5.4 -> 4.0 ms a layer on
// one thread, 3.0 -> 2.2 ms on two (fp32 7.5 -> 7.1). A bf16 cache's scores take `vdpbf16ps`
// where the CPU has it (hot 7-11 % faster; from DRAM 1-3 %). With fewer than two sequences per
// thread, a sequence's KV heads go to different threads.
//
// Layouts (DESIGN.md, "KV layout"): a cache is [num_pages, block_size, kv_heads, head_dim];
// query and out are [num_seqs, q_heads, head_dim], contiguous; block tables
// [num_seqs, table_width] int32; seq_lens [num_seqs] int32. A quantized cache (kv_quant.py:
// int8, fp8 e4m3 / e5m2) has rows of head_dim + 2: the values, then the row's fp16 scale,
// which multiplies the key's dot products and the value's weight. The same 64 sequences, hot,
// one thread, Zen 5 (8 queries on 4 KV heads of 64): bf16 1.37 ms, int8 1.20, e4m3 1.24.

#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_vector.h"

namespace {

using namespace halfmoon;

// Into L2 (prefetcht1), not L1 (prefetcht0), which measured slower: a `bench engine` turn's
// decode attention took 3-6 % less time so (one thread: bf16 2.87 s against 2.97, fp32 6.05
// against 6.40; prefetchnta 4.36 s, bf16), issue 31.
template <typename T>
inline void prefetch(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 2);
}

template <typename T>
inline void widen(const T* row, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = load(row, i);
}

struct Shape {
  int64_t num_seqs, q_heads, kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t row;  // elements of a head's row in the cache: head_dim, + 2 for a quantized one's scale
};

// Each of `rows` rows of `len` scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * len;
    const float top = *std::max_element(row, row + len);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = fast_exp(row[t] - top);
      total += row[t];
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
  }
}

constexpr int64_t kAhead = 8;  // tokens ahead to prefetch: pages are scattered in memory

// One cached token's row of every KV head, in place in its page.
template <typename C>
inline const C* token_row(const C* cache, const int32_t* table, int64_t t, const Shape& s) {
  const int64_t page = table[t / s.block_size], offset = t % s.block_size;
  return cache + (page * s.block_size + offset) * s.kv_heads * s.row;
}

// A token's row of every KV head as fp32 values, each head's scaled when the cache is quantized.
template <typename C>
inline void widen_token(const C* token, const Shape& s, float* out) {
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    const C* head = token + h * s.row;
    float* values = out + h * s.head_dim;
    widen(head, s.head_dim, values);
    if constexpr (kScaled<C>) {
      const float scale = row_scale(head, s.head_dim);
      for (int64_t d = 0; d < s.head_dim; ++d) values[d] *= scale;
    }
  }
}

// One sequence: each query head against the `len` cached tokens of its KV head. Tokens are
// read in order, a row of all KV heads at a time (contiguous within a page), K then V once.
template <typename T, typename C>
void attend(const T* query, const C* k_cache, const C* v_cache, const int32_t* table,
            int64_t len, const Shape& s, T* out) {
  const int64_t group = s.q_heads / s.kv_heads, dim = s.head_dim;
  std::vector<float> q(s.q_heads * dim), acc(s.q_heads * dim, 0.0f), scores(s.q_heads * len);
  for (int64_t i = 0; i < s.q_heads * dim; ++i) q[i] = load(query, i) * s.scale;
  std::vector<float> row(s.kv_heads * dim);  // a token's K or V, widened once for its group
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch(token_row(k_cache, table, t + kAhead, s), s.kv_heads * s.row);
    widen_token(token_row(k_cache, table, t, s), s, row.data());
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const float* key = row.data() + (h / group) * dim;
      const float* qh = q.data() + h * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * key[d];
      scores[h * len + t] = dot;
    }
  }
  softmax_rows(scores.data(), s.q_heads, len);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch(token_row(v_cache, table, t + kAhead, s), s.kv_heads * s.row);
    widen_token(token_row(v_cache, table, t, s), s, row.data());
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const float* value = row.data() + (h / group) * dim;
      const float p = scores[h * len + t];
      float* ah = acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ah[d] += p * value[d];
    }
  }
  for (int64_t i = 0; i < s.q_heads * dim; ++i) store(out, i, acc[i]);
}

#if defined(HALFMOON_VEC)
// The vector path for a head size D and group size G known at compile time: a group's
// queries and accumulators stay in registers, kLanes tokens a tile (16 on AVX-512, 8 on AVX2).

// A head's row of NV vectors, widened to fp32.
template <int NV, typename C>
inline void load_row(const C* row, vfloat* out) {
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) out[c] = vload(row + c * kLanes);
}

// The dot products of a tile's tokens as one vector: lane i of the result sums all lanes of the
// i-th partial product, by pairwise shuffles and adds (three instructions per token where a
// horizontal sum of each takes a dozen in sequence). Per 128 bits, pair_sums(a, b) is a0+a2,
// b0+b2, a1+a3, b1+b3 and quad_sums(ab, cd) the four sums a, b, c, d; token_sums then adds up
// the 128-bit chunks of the kLanes / 4 quads, in token order.
#if HALFMOON_VEC == 512
inline vfloat pair_sums(vfloat a, vfloat b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline vfloat quad_sums(vfloat ab, vfloat cd) {
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline vfloat lane_sums(vfloat x, vfloat y) {  // 128-bit chunks summed in pairs, in order
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline vfloat token_sums(const vfloat* quads) {
  return lane_sums(lane_sums(quads[0], quads[1]), lane_sums(quads[2], quads[3]));
}
#else
inline vfloat pair_sums(vfloat a, vfloat b) {
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
}
inline vfloat quad_sums(vfloat ab, vfloat cd) {
  return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline vfloat token_sums(const vfloat* quads) {
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif

// The vector path reads a stream of KV rows: a sequence's K, then its V, then the next
// sequence's K. Each row read prefetches head h's row kStreamAhead tokens further along that
// stream, so the prefetches (a few lines each) are spread over the work instead of issued a
// tile at a time, which waits on the line-fill buffers before the tile's work can begin
// (decode attention from DRAM 27 % faster, issue 31). `next_*` is the sequence this thread
// most likely takes next (none: `next_len` 0).
constexpr int64_t kStreamAhead = 32;

struct Stream {
  const int32_t* table;
  int64_t len;
  const int32_t* next_table;
  int64_t next_len;
};

// Prefetches head h's row at token `t + kStreamAhead` of `cache` (the pass being read), or
// past its end, of `then` in `then_table` (the pass after it).
// (Forced inline: gcc left it a call inside score_tile's unrolled loops, spilling the
// registers around it, which lost all of the gain.)
template <typename C, int D>
__attribute__((always_inline)) inline void prefetch_ahead(
    const C* cache, const int32_t* table, int64_t len, const C* then, const int32_t* then_table,
    int64_t then_len, int64_t t, int64_t h, const Shape& s) {
  const int64_t ahead = t + kStreamAhead;
  if (ahead < len)
    prefetch(token_row(cache, table, ahead, s) + h * s.row, D);
  else if (ahead - len < then_len)
    prefetch(token_row(then, then_table, ahead - len, s) + h * s.row, D);
}

// Whether a bf16 query's scores (T: the query's type, C: the cache's) take `vdpbf16ps`
// (AVX-512 BF16): it multiplies pairs of bf16 values exactly and sums them in fp32, so a bf16
// cache's keys need no widening (the query stays bf16, unscaled; the scale is applied to the
// sums). A quantized cache's values are exact in bf16 too (8-bit integers, fp8's 3-4
// significant bits): widened to fp32 and packed two vectors into one, they take it as well,
// half the multiplies of fp32 FMAs (their scales applied to the sums).
template <typename T, typename C>
constexpr bool kBf16Dots =
#if HALFMOON_VEC == 512 && defined(__AVX512BF16__)
    std::is_same_v<T, uint16_t> && (std::is_same_v<C, uint16_t> || kScaled<C>);
#else
    false;
#endif

// The G queries' dot products with one token's key row `key` (D values), into dots[j].
template <typename T, typename C, int D, int G>
__attribute__((always_inline)) inline void token_dots(const float* q, const uint16_t* qb,
                                                      const C* key, vfloat* dots) {
#if HALFMOON_VEC == 512 && defined(__AVX512BF16__)
  if constexpr (kBf16Dots<T, C>) {
    constexpr int NP = D / (2 * kLanes);  // 32 bf16 values a vector
    __m512bh k[NP];
#pragma GCC unroll 4
    for (int c = 0; c < NP; ++c) {
      if constexpr (kScaled<C>)  // (high half, low half): the values in their order
        k[c] = _mm512_cvtne2ps_pbh(vload(key + c * 2 * kLanes + kLanes),
                                   vload(key + c * 2 * kLanes));
      else
        k[c] = (__m512bh)_mm512_loadu_si512(key + c * 2 * kLanes);
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < NP; ++c)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qb + j * D + c * 2 * kLanes),
                               k[c]);
      dots[j] = dot;
    }
    return;
  }
#endif
  constexpr int NV = D / kLanes;
  vfloat k[NV];
  load_row<NV>(key, k);
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j) {
    vfloat dot = vmul(vload(q + j * D), k[0]);
#pragma GCC unroll 16
    for (int c = 1; c < NV; ++c) dot = vfmadd(vload(q + j * D + c * kLanes), k[c], dot);
    dots[j] = dot;
  }
}

// Scores of the G queries against `n` <= kLanes tokens from `t0` of KV head `h`; query j's land
// in scores[j * len + t0 ...]. The queries are `q` ([G][D], fp32, pre-scaled), or with
// kBf16Dots `qb` (the same rows in bf16, unscaled). A quantized cache's key scales multiply
// the sums.
template <typename T, typename C, int D, int G>
inline void score_tile(const float* q, const uint16_t* qb, const C* k_cache, const C* v_cache,
                       const Stream& at, int64_t t0, int n, int64_t h, const Shape& s,
                       float* scores) {
  const int32_t* table = at.table;
  const int64_t len = at.len;
  constexpr int NQ = kLanes / 4;  // quads of tokens in a tile
  vfloat quads[G][NQ];
  alignas(64) float key_scales[kLanes];
#pragma GCC unroll 4
  for (int m = 0; m < NQ; ++m) {
    vfloat pairs[G][2];
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
      vfloat dots[2][G];
#pragma GCC unroll 2
      for (int r = 0; r < 2; ++r) {
        const int64_t t = t0 + std::min(4 * m + 2 * p + r, n - 1);  // past n: not stored below
        prefetch_ahead<C, D>(k_cache, table, len, v_cache, table, len, t, h, s);
        const C* key = token_row(k_cache, table, t, s) + h * s.row;
        if constexpr (kScaled<C>)
          key_scales[4 * m + 2 * p + r] = row_scale(key, D) * kVectorUnit<C>;
        token_dots<T, C, D, G>(q, qb, key, dots[r]);
      }
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) pairs[j][p] = pair_sums(dots[0][j], dots[1][j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) quads[j][m] = quad_sums(pairs[j][0], pairs[j][1]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j) {
    vfloat sums = token_sums(quads[j]);
    if constexpr (kBf16Dots<T, C>) sums = vmul(sums, vset(s.scale));
    if constexpr (kScaled<C>) sums = vmul(sums, vload(key_scales));
    vstore_first(scores + j * len + t0, sums, n);
  }
}

// Prefetches the rows of KV heads [h0, h1) of the tokens in [t0, t1).
template <typename C>
inline void prefetch_tile(const C* cache, const int32_t* table, int64_t t0, int64_t t1,
                          int64_t h0, int64_t h1, const Shape& s) {
  for (int64_t t = t0; t < t1; ++t)
    prefetch(token_row(cache, table, t, s) + h0 * s.row, (h1 - h0) * s.row);
}

// Vectors of a head's row the V pass sums at a time: the whole row where the group's sums fit
// the registers beside it, else the largest power-of-two part of it that does (head size 128,
// 8 queries a KV head, AVX-512: 1.2x faster fp32, 1.5x bf16 than the whole row, its sums
// spilled; 64 sequences of 200-400 tokens, one thread, Zen 4).
template <int G, int NV>
constexpr int value_chunk() {
  int chunk = NV;
  while (chunk > 1 && (G + 1) * chunk + 1 > kRegisters) chunk /= 2;
  return chunk;
}

// The tile's tokens [t0, t1) of KV head h: their V rows weighted by the G queries' scores,
// summed into acc ([G][D]), `CV` vectors of each row at a time (a quantized row's scale
// folded into its weights).
template <typename C, int D, int G>
inline void value_tile(const C* k_cache, const C* v_cache, const Stream& at, int64_t t0,
                       int64_t t1, int64_t h, const Shape& s, const float* scores, float* acc) {
  constexpr int NV = D / kLanes, CV = value_chunk<G, NV>();
  const int64_t len = at.len;
#pragma GCC unroll 1
  for (int c0 = 0; c0 < NV; c0 += CV) {
    vfloat sum[G][CV];
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j)
#pragma GCC unroll 16
      for (int c = 0; c < CV; ++c) sum[j][c] = vload(acc + j * D + (c0 + c) * kLanes);
    for (int64_t t = t0; t < t1; ++t) {
      const C* head = token_row(v_cache, at.table, t, s) + h * s.row;
      const C* value = head + c0 * kLanes;
      if (c0 == 0)
        prefetch_ahead<C, D>(v_cache, at.table, len, k_cache, at.next_table, at.next_len, t, h,
                             s);
      float value_scale = 1.0f;
      if constexpr (kScaled<C>) value_scale = row_scale(head, D) * kVectorUnit<C>;
      vfloat v[CV];
      load_row<CV>(value, v);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        const vfloat weight = vset(kScaled<C> ? scores[j * len + t] * value_scale
                                              : scores[j * len + t]);
#pragma GCC unroll 16
        for (int c = 0; c < CV; ++c) sum[j][c] = vfmadd(weight, v[c], sum[j][c]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j)
#pragma GCC unroll 16
      for (int c = 0; c < CV; ++c) vstore(acc + j * D + (c0 + c) * kLanes, sum[j][c]);
  }
}

// A sequence's KV heads [h0, h1): their queries' attention over its `at.len` cached tokens,
// kLanes tokens at a time, each tile's rows (contiguous within a page) read for every head.
// `q` holds (h1 - h0) * G * D floats (`qb` as many bf16 values), `scores` (h1 - h0) * G * len,
// `acc` (h1 - h0) * G * D.
template <typename T, typename C, int D, int G>
void attend_heads(const T* query, const C* k_cache, const C* v_cache, const Stream& at,
                  int64_t h0, int64_t h1, const Shape& s, float* q, uint16_t* qb, float* scores,
                  float* acc, T* out) {
  const int32_t* table = at.table;
  const int64_t len = at.len, rows = (h1 - h0) * G;
  if constexpr (kBf16Dots<T, C>)
    std::copy(query + h0 * G * D, query + (h0 * G + rows) * D, qb);
  else
    for (int64_t i = 0; i < rows * D; ++i) q[i] = load(query + h0 * G * D, i) * s.scale;
  prefetch_tile(k_cache, table, 0, std::min(kStreamAhead, len), h0, h1, s);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t t1 = std::min<int64_t>(t0 + kLanes, len);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t r = (h - h0) * G;
      score_tile<T, C, D, G>(q + r * D, qb + r * D, k_cache, v_cache, at, t0, int(t1 - t0), h, s,
                          scores + r * len);
    }
  }
  softmax_rows(scores, rows, len);
  std::fill(acc, acc + rows * D, 0.0f);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t t1 = std::min<int64_t>(t0 + kLanes, len);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t r = (h - h0) * G;
      value_tile<C, D, G>(k_cache, v_cache, at, t0, t1, h, s, scores + r * len, acc + r * D);
    }
  }
  for (int64_t i = 0; i < rows * D; ++i) store(out + h0 * G * D, i, acc[i]);
}

// Sequences are the unit of work, split by KV heads when there are too few of them to keep
// every thread busy (a lone long sequence at light load).
template <typename T, typename C, int D, int G>
void decode_fixed(const T* query, const C* k_cache, const C* v_cache, const int32_t* tables,
                  const int32_t* seq_lens, const Shape& s, int num_threads, T* out) {
  const int64_t row = s.q_heads * D;
  const int64_t parts = s.num_seqs >= 2 * num_threads ? 1 : s.kv_heads;
  const int64_t heads = s.kv_heads / parts;  // parts is 1 or kv_heads
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(heads * G * D), acc(heads * G * D), scores;
    std::vector<uint16_t> qb(heads * G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < s.num_seqs * parts; ++item) {
      const int64_t seq = item / parts, h0 = (item % parts) * heads;
      scores.resize(heads * G * seq_lens[seq]);
      const bool next = parts == 1 && seq + 1 < s.num_seqs;  // else the same sequence's heads
      const Stream at{tables + seq * s.table_width, seq_lens[seq],
                      next ? tables + (seq + 1) * s.table_width : nullptr,
                      next ? seq_lens[seq + 1] : 0};
      attend_heads<T, C, D, G>(query + seq * row, k_cache, v_cache, at, h0, h0 + heads, s, q.data(),
                            qb.data(), scores.data(), acc.data(), out + seq * row);
    }
  }
}
#endif  // HALFMOON_VEC

template <typename T, typename C>
void decode(const void* query_, const void* k_cache_, const void* v_cache_,
            const int32_t* tables, const int32_t* seq_lens, const Shape& s, int num_threads,
            void* out_) {
  const T* query = static_cast<const T*>(query_);
  const C *k_cache = static_cast<const C*>(k_cache_), *v_cache = static_cast<const C*>(v_cache_);
  T* out = static_cast<T*>(out_);
#if defined(HALFMOON_VEC)
  // e5m2 (the 8-bit format least worth serving: 2 mantissa bits) keeps to the plain loops:
  // each format on the vector path costs the build its instantiations (~5 s a variant).
  if constexpr (!std::is_same_v<C, fp8_e5m2>) {
    const int64_t group = s.q_heads / s.kv_heads;
#define HALFMOON_FIXED(D, G)                                                                   \
  if (s.head_dim == D && group == G)                                                           \
    return decode_fixed<T, C, D, G>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
    HALFMOON_FIXED(64, 1) HALFMOON_FIXED(64, 2) HALFMOON_FIXED(64, 4) HALFMOON_FIXED(64, 8)
    HALFMOON_FIXED(128, 1) HALFMOON_FIXED(128, 2) HALFMOON_FIXED(128, 4) HALFMOON_FIXED(128, 8)
#undef HALFMOON_FIXED
  }
#endif
  const int64_t row = s.q_heads * s.head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    attend(query + seq * row, k_cache, v_cache, tables + seq * s.table_width, seq_lens[seq], s,
           out + seq * row);
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (query and out alike). kv_format: 0 the caches in that dtype
// too, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2 (rows of head_dim values and an fp16 scale, `row`
// elements apart: kernels/kv_quant.py). Every sequence has len >= 1.
void paged_decode_attention(const void* query, const void* k_cache, const void* v_cache,
                            const int32_t* tables, const int32_t* seq_lens, int64_t num_seqs,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t table_width, float scale, int dtype,
                            int kv_format, int64_t row, int num_threads, void* out) {
  const Shape s{num_seqs, q_heads, kv_heads, head_dim, block_size, table_width, scale, row};
  const auto run = [&](auto query_type) {
    using T = decltype(query_type);
    if (kv_format == 1)
      decode<T, int8_t>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
    else if (kv_format == 2)
      decode<T, fp8_e4m3>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
    else if (kv_format == 3)
      decode<T, fp8_e5m2>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
    else
      decode<T, T>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
  };
  if (dtype == 1)
    run(uint16_t{});
  else
    run(float{});
}
}
