// Paged prefill attention for CPUs with AMX (bf16, head size 64): ragged runs of new tokens,
// each attending to its cached prefix and causally to itself, K and V read from the pages.
// Built and loaded by cpu_build.py, called by cpu_prefill.py; the entry point answers 1
// (unsupported) where the build machine lacks AMX or the shape is another, and the torch
// reference serves instead.
//
// Why: torch's fused SDPA runs a 272-token causal run of 8 heads at ~140 GFLOP/s on one
// Sapphire Rapids core; this engine's bf16 prefill steps spent ~1.1 s of a 9 s `bench engine`
// turn there (a 2,048-token step of 7 runs: 6.5-7 ms a layer dense, 9 ms over the pages, 2.6 ms
// here on one thread, 1.7 ms on two). AMX multiplies 16x32 by 32x16 bf16 tiles into fp32 in one
// instruction.
//
// Work: a task is one run's KV head. Its context's K is packed once as K^T in AMX's
// pair-interleaved (VNNI) layout, 16 tokens by 32 dims a tile, and V as pairs of tokens, 16
// dims a tile; then for each block of 16 query tokens and each query head of the group, three
// stages: the scores of every token up to the block's last position (AMX), each row's softmax
// over the tokens it sees (AVX-512; the probabilities rounded to bf16), and the probabilities
// times V (AMX, the output in four tile registers throughout: the row maxima are known, so
// nothing is rescaled). Scores and sums are fp32. Each task is one thread's from start to
// end, so the result does not depend on the number of threads.
//
// Layouts (DESIGN.md, "KV layout"): a cache is [num_pages, block_size, kv_heads, head_dim];
// query and out are [tokens, q_heads, head_dim], contiguous; cu_seqlens [runs + 1], block
// tables [runs, table_width] and prefix_lens [runs], int32.

#include <cstdlib>
#include <memory>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_vector.h"

namespace {

using namespace halfmoon;

#if defined(HALFMOON_AMX)
constexpr int64_t kDim = 64;              // head size this kernel serves
constexpr int64_t kSteps = kDim / 32;     // K-dimension tiles of a Q row (32 bf16 each)
constexpr int64_t kCols = kDim / 16;      // output tiles of 16 fp32 columns
constexpr int64_t kTileWords = 16 * 16;   // a packed tile: 16 rows of 16 bf16 pairs
constexpr int64_t kBlockWords = 2 * kSteps * kTileWords;  // K of 32 tokens (= V's, kCols * 256)

struct Shape {
  int64_t q_heads, kv_heads, block_size, table_width;
  float scale;
};

struct Run {
  int64_t start, len, prefix;
  int64_t context() const { return prefix + len; }
};

const uint16_t* token_row(const uint16_t* cache, const int32_t* table, int64_t t, int64_t head,
                          const Shape& s) {
  const int64_t page = table[t / s.block_size], offset = t % s.block_size;
  return cache + ((page * s.block_size + offset) * s.kv_heads + head) * kDim;
}

// The 16 x 16 32-bit elements of `rows` transposed in place (four rounds of shuffles).
inline void transpose16(__m512i* rows) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each row now holds, in each 128-bit lane L, elements of 4 columns from rows 4L'..4L'+3.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    rows[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    rows[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The run's context for one KV head: K as K^T tiles (tile [group][step][pair][token] of 32-bit
// dim pairs, 16-token groups) and V as token-pair tiles ([block][col][pair][dim] of 32-bit
// token pairs, 32-token blocks), zero past the context.
void pack(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, const Run& run,
          int64_t head, const Shape& s, uint32_t* k_out, uint32_t* v_out) {
  const int64_t context = run.context(), blocks = (context + 31) / 32;
  for (int64_t t0 = 0; t0 < 2 * blocks * 16; t0 += 16) {  // K, 16 tokens at a time
    __m512i rows[2][16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t t = t0 + j;
      const uint16_t* key = t < context ? token_row(k_cache, table, t, head, s) : nullptr;
      for (int64_t k = 0; k < kSteps; ++k) {
        rows[k][j] = key ? _mm512_loadu_si512(key + k * 32) : _mm512_setzero_si512();
      }
    }
    for (int64_t k = 0; k < kSteps; ++k) {
      transpose16(rows[k]);
      uint32_t* tile = k_out + ((t0 / 16) * kSteps + k) * kTileWords;
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(tile + p * 16, rows[k][p]);
    }
  }
  // V: token pairs' dims interleaved, 16 dims (one tile's row) per permute.
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < blocks * 32; t += 2) {
    __m512i first[2], second[2];  // dims 0-31 and 32-63 of tokens t and t + 1
    const uint16_t* a = t < context ? token_row(v_cache, table, t, head, s) : nullptr;
    const uint16_t* b = t + 1 < context ? token_row(v_cache, table, t + 1, head, s) : nullptr;
    for (int half = 0; half < 2; ++half) {
      first[half] = a ? _mm512_loadu_si512(a + half * 32) : _mm512_setzero_si512();
      second[half] = b ? _mm512_loadu_si512(b + half * 32) : _mm512_setzero_si512();
    }
    uint32_t* row = v_out + (t / 32) * kBlockWords + ((t % 32) / 2) * 16;
    for (int half = 0; half < 2; ++half) {
      uint32_t* tile = row + 2 * half * kTileWords;
      _mm512_store_si512(tile, _mm512_permutex2var_epi16(first[half], low, second[half]));
      _mm512_store_si512(tile + kTileWords,
                         _mm512_permutex2var_epi16(first[half], high, second[half]));
    }
  }
}

// e^x for x <= ~0 (a row's scores less its largest): vexp's split with a degree-4 polynomial
// for 2^f (relative error 3.6e-6, ample for probabilities rounded to bf16) and no clamps
// (scalef takes a very negative x to 0).
inline __m512 exp_below_zero16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_fmsub_ps(x, log2e, k);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.676037e-3f), f, _mm512_set1_ps(5.5922036e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022107e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931210e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001f));
  return _mm512_scalef_ps(p, k);
}

// A thread's buffer of `count` T, 64-byte aligned, kept between calls; `Slot` tells a thread's
// buffers apart (scores, probabilities, the packed context).
template <typename T, int Slot>
T* scratch(int64_t count) {
  thread_local std::unique_ptr<T, decltype(&std::free)> buffer(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (count > capacity) {
    capacity = (count + 1023) / 1024 * 1024;
    buffer.reset(static_cast<T*>(std::aligned_alloc(64, capacity * sizeof(T))));
  }
  return buffer.get();
}

// The scores of the query tiles (4, 5: 16 rows, dims 0-31 and 32-63) against one 16-token
// group of packed K^T, through tile 0, stored as 16 rows `stride` bytes apart.
inline void group_scores(const uint32_t* keys, float* to, int64_t stride) {
  _tile_zero(0);
  _tile_loadd(6, keys, 64);
  _tile_loadd(7, keys + kTileWords, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(0, 5, 7);
  _tile_stored(0, to, stride);
}

// Query rows `row0 .. row0 + rows` of one head against its packed context, causal at positions
// `pos0 + r`; writes the normalized output rows. Three stages, each left to its own unit: the
// scores of every visible token (AMX, 16 tokens at a time), each row's softmax
// (AVX-512, rounded to bf16), the probabilities times V (AMX, into four output tiles).
void attend(const uint16_t* query, const uint32_t* keys, const uint32_t* values, int64_t head,
            int64_t row0, int64_t rows, int64_t pos0, const Shape& s, uint16_t* out) {
  alignas(64) uint16_t q[16 * kDim] = {};
  alignas(64) float acc[16 * kDim];
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(query + ((row0 + r) * s.q_heads + head) * kDim, kDim, q + r * kDim);
  }
  const int64_t last = pos0 + rows - 1, blocks = last / 32 + 1, width = blocks * 32;
  float* scores = scratch<float, 0>(16 * width);
  uint16_t* probs = scratch<uint16_t, 1>(16 * width);

  _tile_loadd(4, q, kDim * 2);
  _tile_loadd(5, q + 32, kDim * 2);
  for (int64_t c = 0; c < 2 * blocks; ++c) {  // 16-token groups, two to a 32-token block
    group_scores(keys + c * kSteps * kTileWords, scores + c * 16, width * 4);
  }

  const __m512 scale = _mm512_set1_ps(s.scale);
  float sums[16];
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores + r * width;
    uint16_t* p = probs + r * width;
    const int64_t seen = pos0 + r + 1, full = seen / 16 * 16;  // tokens this row sees
    const __mmask16 tail = (1u << (seen - full)) - 1;
    __m512 high = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; t += 16) high = _mm512_max_ps(high, _mm512_load_ps(row + t));
    if (tail) high = _mm512_mask_max_ps(high, tail, high, _mm512_load_ps(row + full));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(high) * s.scale);
    __m512 sum = _mm512_setzero_ps();
    auto exps = [&](int64_t t, __mmask16 keep) {
      const __m512 e = exp_below_zero16(_mm512_fmsub_ps(_mm512_load_ps(row + t), scale, top));
      const __m512 kept = _mm512_maskz_mov_ps(keep, e);
      sum = _mm512_add_ps(sum, kept);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p + t), to_bf16(kept));
    };
    for (int64_t t = 0; t < full; t += 16) exps(t, 0xFFFF);
    int64_t t = full;
    if (tail) exps(t, tail), t += 16;
    for (; t < width; t += 16) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(p + t), _mm256_setzero_si256());
    }
    sums[r] = _mm512_reduce_add_ps(sum);
  }

  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* tile = values + b * kBlockWords;
    _tile_loadd(4, probs + b * 32, width * 2);
    _tile_loadd(6, tile, 64);
    _tile_loadd(7, tile + kTileWords, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, tile + 2 * kTileWords, 64);
    _tile_loadd(7, tile + 3 * kTileWords, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, acc, kDim * 4);
  _tile_stored(1, acc + 16, kDim * 4);
  _tile_stored(2, acc + 32, kDim * 4);
  _tile_stored(3, acc + 48, kDim * 4);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / sums[r]);
    uint16_t* row = out + ((row0 + r) * s.q_heads + head) * kDim;
#pragma GCC unroll 4
    for (int64_t c = 0; c < kCols; ++c) {
      vstore(row + c * 16, _mm512_mul_ps(_mm512_load_ps(acc + r * kDim + c * 16), inverse));
    }
  }
}

void prefill(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache,
             const int32_t* cu_seqlens, const int32_t* tables, const int32_t* prefix_lens,
             int64_t num_runs, const Shape& s, int num_threads, uint16_t* out) {
  std::vector<Run> runs(num_runs);
  for (int64_t i = 0; i < num_runs; ++i) {
    runs[i] = {cu_seqlens[i], cu_seqlens[i + 1] - cu_seqlens[i], prefix_lens[i]};
  }
  // A task is one run's KV head: its context packed once, in the thread's cache, for all its
  // query blocks and heads. The costliest first, so that the last ones handed out are short.
  std::vector<int64_t> tasks(num_runs * s.kv_heads);
  for (size_t i = 0; i < tasks.size(); ++i) tasks[i] = int64_t(i);
  auto cost = [&](int64_t task) {
    const Run& run = runs[task / s.kv_heads];
    return run.len * (run.prefix + run.len / 2);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  const int64_t group = s.q_heads / s.kv_heads;
#pragma omp parallel num_threads(num_threads)
  {
    const ThreadTiles tiles;
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) {
      const int64_t index = tasks[i] / s.kv_heads, head = tasks[i] % s.kv_heads;
      const Run& run = runs[index];
      const int64_t words = (run.context() + 31) / 32 * kBlockWords;
      uint32_t* keys = scratch<uint32_t, 2>(2 * words);
      pack(k_cache, v_cache, tables + index * s.table_width, run, head, s, keys, keys + words);
      for (int64_t first = 0; first < run.len; first += 16) {
        const int64_t rows = std::min<int64_t>(16, run.len - first);
        for (int64_t g = 0; g < group; ++g) {
          attend(query, keys, keys + words, head * group + g, run.start + first, rows,
                 run.prefix + first, s, out);
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" {

// 1 when this build can serve (AMX compiled in and granted by the kernel), else 0.
int amx_ready() { return halfmoon::amx_usable(); }

// 0 when done; 1 when this build or shape is not served (nothing written).
int prefill_attention_bf16(const void* query, const void* k_cache, const void* v_cache,
                           const int32_t* cu_seqlens, const int32_t* tables,
                           const int32_t* prefix_lens, int64_t num_runs, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t table_width, float scale, int num_threads, void* out) {
#if defined(HALFMOON_AMX)
  if (!amx_permitted() || head_dim != kDim || block_size % 16 != 0 || q_heads % kv_heads != 0) {
    return 1;
  }
  const Shape s{q_heads, kv_heads, block_size, table_width, scale};
  prefill(static_cast<const uint16_t*>(query), static_cast<const uint16_t*>(k_cache),
          static_cast<const uint16_t*>(v_cache), cu_seqlens, tables, prefix_lens, num_runs, s,
          num_threads, static_cast<uint16_t*>(out));
  return 0;
#else
  return 1;
#endif
}
}
