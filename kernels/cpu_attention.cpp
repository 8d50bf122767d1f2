// Paged decode attention for CPUs: one query token per sequence over its cached tokens, read
// in place from the pages (no gather), K and V each read once for all query heads of a KV
// head. Built and loaded by cpu_build.py, called by cpu_attention.py.
//
// Layouts (DESIGN.md, "KV layout"): a cache is [num_pages, block_size, kv_heads, head_dim];
// query and out are [num_seqs, q_heads, head_dim], contiguous; block tables
// [num_seqs, table_width] int32; seq_lens [num_seqs] int32.

#include <vector>

#include "cpu_common.h"

namespace {

using namespace halfmoon;

template <typename T>
inline void prefetch(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

template <typename T>
inline void widen(const T* row, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = load(row, i);
}

struct Shape {
  int64_t num_seqs, q_heads, kv_heads, head_dim, block_size, table_width;
  float scale;
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
template <typename T>
inline const T* token_row(const T* cache, const int32_t* table, int64_t t, const Shape& s) {
  const int64_t page = table[t / s.block_size], offset = t % s.block_size;
  return cache + (page * s.block_size + offset) * s.kv_heads * s.head_dim;
}

// One sequence: each query head against the `len` cached tokens of its KV head. Tokens are
// read in order, a row of all KV heads at a time (contiguous within a page), K then V once.
template <typename T>
void attend(const T* query, const T* k_cache, const T* v_cache, const int32_t* table,
            int64_t len, const Shape& s, T* out) {
  const int64_t group = s.q_heads / s.kv_heads, dim = s.head_dim;
  std::vector<float> q(s.q_heads * dim), acc(s.q_heads * dim, 0.0f), scores(s.q_heads * len);
  for (int64_t i = 0; i < s.q_heads * dim; ++i) q[i] = load(query, i) * s.scale;
  std::vector<float> row(s.kv_heads * dim);  // a token's K or V, widened once for its group
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch(token_row(k_cache, table, t + kAhead, s), s.kv_heads * dim);
    widen(token_row(k_cache, table, t, s), s.kv_heads * dim, row.data());
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
    if (t + kAhead < len) prefetch(token_row(v_cache, table, t + kAhead, s), s.kv_heads * dim);
    widen(token_row(v_cache, table, t, s), s.kv_heads * dim, row.data());
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

// Calls visit(t, h, row) for each of the `len` cached tokens t in order and each KV head h,
// `row` that head's D values widened to fp32: a dense token row (every KV head, contiguous
// in its page) read at a time, the rows kAhead tokens on prefetched.
template <typename T, int D, typename Visit>
inline void stream_tokens(const T* cache, const int32_t* table, int64_t len, const Shape& s,
                          Visit&& visit) {
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch(token_row(cache, table, t + kAhead, s), s.kv_heads * D);
    const T* heads = token_row(cache, table, t, s);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      float row[D];
      for (int d = 0; d < D; ++d) row[d] = load(heads + h * D, d);
      visit(t, h, row);
    }
  }
}

// One sequence with the head size D and group size G known at compile time (the inner loops
// unroll, a group's queries stay in registers): K of every token read once, then its V.
template <typename T, int D, int G>
void attend_fixed(const T* query, const T* k_cache, const T* v_cache, const int32_t* table,
                  int64_t len, const Shape& s, float* q, float* scores, float* acc, T* out) {
  const int64_t rows = s.kv_heads * G;
  for (int64_t i = 0; i < rows * D; ++i) q[i] = load(query, i) * s.scale;
  stream_tokens<T, D>(k_cache, table, len, s, [&](int64_t t, int64_t h, const float* k) {
    for (int j = 0; j < G; ++j) {
      const float* qj = q + (h * G + j) * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += qj[d] * k[d];
      scores[(h * G + j) * len + t] = dot;
    }
  });
  softmax_rows(scores, rows, len);
  std::fill(acc, acc + rows * D, 0.0f);
  stream_tokens<T, D>(v_cache, table, len, s, [&](int64_t t, int64_t h, const float* v) {
    for (int j = 0; j < G; ++j) {
      const float p = scores[(h * G + j) * len + t];
      float* aj = acc + (h * G + j) * D;
      for (int d = 0; d < D; ++d) aj[d] += p * v[d];
    }
  });
  for (int64_t i = 0; i < rows * D; ++i) store(out, i, acc[i]);
}

template <typename T, int D, int G>
void decode_fixed(const T* query, const T* k_cache, const T* v_cache, const int32_t* tables,
                  const int32_t* seq_lens, const Shape& s, int num_threads, T* out) {
  const int64_t row = s.q_heads * D;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(row), acc(row), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
      scores.resize(s.q_heads * seq_lens[seq]);
      attend_fixed<T, D, G>(query + seq * row, k_cache, v_cache, tables + seq * s.table_width,
                            seq_lens[seq], s, q.data(), scores.data(), acc.data(),
                            out + seq * row);
    }
  }
}

template <typename T>
void decode(const void* query_, const void* k_cache_, const void* v_cache_,
            const int32_t* tables, const int32_t* seq_lens, const Shape& s, int num_threads,
            void* out_) {
  const T *query = static_cast<const T*>(query_), *k_cache = static_cast<const T*>(k_cache_),
          *v_cache = static_cast<const T*>(v_cache_);
  T* out = static_cast<T*>(out_);
  const int64_t group = s.q_heads / s.kv_heads;
#define HALFMOON_FIXED(D, G)                                                                   \
  if (s.head_dim == D && group == G)                                                           \
    return decode_fixed<T, D, G>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
  HALFMOON_FIXED(64, 1) HALFMOON_FIXED(64, 2) HALFMOON_FIXED(64, 4) HALFMOON_FIXED(64, 8)
  HALFMOON_FIXED(128, 1) HALFMOON_FIXED(128, 2) HALFMOON_FIXED(128, 4) HALFMOON_FIXED(128, 8)
#undef HALFMOON_FIXED
  const int64_t row = s.q_heads * s.head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    attend(query + seq * row, k_cache, v_cache, tables + seq * s.table_width, seq_lens[seq], s,
           out + seq * row);
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (query, caches and out alike). Every sequence has len >= 1.
void paged_decode_attention(const void* query, const void* k_cache, const void* v_cache,
                            const int32_t* tables, const int32_t* seq_lens, int64_t num_seqs,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t table_width, float scale, int dtype,
                            int num_threads, void* out) {
  const Shape s{num_seqs, q_heads, kv_heads, head_dim, block_size, table_width, scale};
  if (dtype == 1)
    decode<uint16_t>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
  else
    decode<float>(query, k_cache, v_cache, tables, seq_lens, s, num_threads, out);
}
}
