// The per-token layers around attention and the MLP for CPUs, each one pass over its rows
// where the torch references take 4-8 ops: RMSNorm (with the residual add), rotary embedding
// (in place), SwiGLU, and the KV write into the pages. Results round as the references' ops
// do (in the tensors' dtype after each op that torch would round), so bf16 outputs match.
// Built and loaded by cpu_build.py, called by cpu_elementwise.py; dtype 0 is float32, 1 bf16.

#include "cpu_common.h"
#include "cpu_quant.h"
#include "cpu_vector.h"

namespace {

using namespace halfmoon;

// sum = a + b, rounded to T as torch's add rounds.
template <typename T>
void add_rows(const T* a, const T* b, int64_t dim, T* sum) {
  int64_t done = 0;
#if defined(HALFMOON_VEC)
  for (; done + kLanes <= dim; done += kLanes)
    vstore(sum + done, vadd(vload(a + done), vload(b + done)));
#endif
#pragma omp simd
  for (int64_t i = done; i < dim; ++i) store(sum, i, load(a, i) + load(b, i));
}

template <typename T>
float sum_of_squares(const T* row, int64_t dim) {
  float squares = 0.0f;
  int64_t done = 0;
#if defined(HALFMOON_VEC)
  vfloat partial = vzero();
  for (; done + kLanes <= dim; done += kLanes) {
    const vfloat value = vload(row + done);
    partial = vfmadd(value, value, partial);
  }
  squares = vsum(partial);
#endif
#pragma omp simd reduction(+ : squares)
  for (int64_t i = done; i < dim; ++i) squares += load(row, i) * load(row, i);
  return squares;
}

// out = weight * (x' * rsqrt(mean(x'^2) + eps)), x' = x + residual (when given; written to
// residual_out). Rows of `dim` elements, contiguous.
template <typename T>
void rms_norm(const T* x, const T* residual, const T* weight, float eps, int64_t rows,
              int64_t dim, int num_threads, T* out, T* residual_out) {
#pragma omp parallel for num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    if (residual != nullptr) {
      add_rows(xr, residual + r * dim, dim, residual_out + r * dim);
      xr = residual_out + r * dim;
    }
    const float inverse = 1.0f / std::sqrt(sum_of_squares(xr, dim) / dim + eps);
    T* out_row = out + r * dim;
    int64_t done = 0;
#if defined(HALFMOON_VEC)
    const vfloat scale = vset(inverse);
    for (; done + kLanes <= dim; done += kLanes)  // the loop below, a vector at a time
      vstore(out_row + done,
             vmul(vload(weight + done), vround_as(xr, vmul(vload(xr + done), scale))));
#endif
#pragma omp simd
    for (int64_t i = done; i < dim; ++i)
      store(out_row, i, load(weight, i) * round_as(xr, load(xr, i) * inverse));
  }
}

// Rotates `heads` heads of `dim` (contiguous, one token's heads `dim` apart) in place,
// half-split (NeoX) style, by the cos/sin row of each token's position.
template <typename T>
void rotate(T* x, int64_t token_stride, int64_t heads, int64_t dim, const int64_t* positions,
            const float* cos_sin, int64_t tokens, int num_threads) {
  const int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads)
  for (int64_t n = 0; n < tokens; ++n) {
    const float* cos = cos_sin + positions[n] * dim;
    const float* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + n * token_stride + h * dim;
      int64_t done = 0;
#if defined(HALFMOON_VEC)
      for (; done + kLanes <= half; done += kLanes) {  // the loop below, a vector at a time
        const vfloat first = vload(row + done), second = vload(row + done + half);
        const vfloat c = vload(cos + done), s = vload(sin + done);
        vstore(row + done, vsub(vmul(first, c), vmul(second, s)));
        vstore(row + done + half, vadd(vmul(second, c), vmul(first, s)));
      }
#endif
#pragma omp simd
      for (int64_t i = done; i < half; ++i) {
        const float first = load(row, i), second = load(row, i + half);
        store(row, i, first * cos[i] - second * sin[i]);
        store(row, i + half, second * cos[i] + first * sin[i]);
      }
    }
  }
}

// out[r] = silu(gate) * up for x[r] = [gate | up], each `width` wide.
template <typename T>
void silu_and_mul(const T* x, int64_t rows, int64_t width, int num_threads, T* out) {
#pragma omp parallel for num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * width;
    const T* up = gate + width;
    T* out_row = out + r * width;
    int64_t done = 0;
#if defined(HALFMOON_VEC)
    for (; done + kLanes <= width; done += kLanes) {  // the loop below, a vector at a time
      const vfloat g = vload(gate + done);
      const vfloat e = vexp(vsub(vzero(), vmax(g, vset(-60.0f))));
      const vfloat sigmoid = vreciprocal(vadd(vset(1.0f), e));
      const vfloat silu = vround_as(gate, vmul(g, sigmoid));
      vstore(out_row + done, vmul(silu, vload(up + done)));
    }
#endif
#pragma omp simd
    for (int64_t i = done; i < width; ++i) {
      const float g = load(gate, i);
      // silu(g) = g / (1 + e^-g); below g = -60 the sigmoid is taken at -60 (9e-27), as good as 0.
      const float sigmoid = reciprocal(1.0f + fast_exp(-std::max(g, -60.0f)));
      store(out_row, i, round_as(gate, g * sigmoid) * load(up, i));
    }
  }
}

// Row n of `src` (`row` elements, `src_stride` apart) to row slots[n] of `cache`; -1 skips.
// A prefill step's rows (MBs, to pages not in cache) are shared among the threads; a decode
// step's few are not worth waking them.
constexpr int64_t kParallelRows = 256;

template <typename T>
void store_rows(const T* src, int64_t src_stride, const int64_t* slots, int64_t tokens,
                int64_t row, int num_threads, T* cache) {
#pragma omp parallel for num_threads(num_threads) if (tokens >= kParallelRows)
  for (int64_t n = 0; n < tokens; ++n) {
    if (slots[n] >= 0) std::memcpy(cache + slots[n] * row, src + n * src_stride, row * sizeof(T));
  }
}

// Each row of `heads` x `dim` values of the tokens with a slot, quantized (cpu_quant.h) into a
// cache of rows of `dim` codes and a 2-byte scale.
template <typename C, typename T>
void store_quantized(const T* src, int64_t src_stride, const int64_t* slots, int64_t tokens,
                     int64_t heads, int64_t dim, int num_threads, uint8_t* cache) {
  const int64_t width = dim + 2;
#pragma omp parallel for num_threads(num_threads) if (tokens >= kParallelRows)
  for (int64_t n = 0; n < tokens; ++n) {
    if (slots[n] < 0) continue;
    for (int64_t h = 0; h < heads; ++h)
      quantize_row<C>(src + n * src_stride + h * dim, dim, cache + (slots[n] * heads + h) * width);
  }
}

template <typename T>
void store_quantized_kv(const void* key, const void* value, int64_t key_stride,
                        int64_t value_stride, const int64_t* slots, int64_t tokens, int64_t heads,
                        int64_t dim, int kv_format, int num_threads, void* k_cache,
                        void* v_cache) {
  const auto run = [&](auto code) {
    using C = decltype(code);
    store_quantized<C>(static_cast<const T*>(key), key_stride, slots, tokens, heads, dim,
                       num_threads, static_cast<uint8_t*>(k_cache));
    store_quantized<C>(static_cast<const T*>(value), value_stride, slots, tokens, heads, dim,
                       num_threads, static_cast<uint8_t*>(v_cache));
  };
  if (kv_format == 1)
    run(int8_t{});
  else if (kv_format == 2)
    run(fp8_e4m3{});
  else
    run(fp8_e5m2{});
}

}  // namespace

extern "C" {

void rms_norm(const void* x, const void* residual, const void* weight, float eps, int64_t rows,
              int64_t dim, int dtype, int num_threads, void* out, void* residual_out) {
  if (dtype == 1)
    rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
             static_cast<const uint16_t*>(weight), eps, rows, dim, num_threads,
             static_cast<uint16_t*>(out), static_cast<uint16_t*>(residual_out));
  else
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual),
             static_cast<const float*>(weight), eps, rows, dim, num_threads,
             static_cast<float*>(out), static_cast<float*>(residual_out));
}

void rotary_embedding(void* x, int64_t token_stride, int64_t heads, int64_t dim,
                      const int64_t* positions, const float* cos_sin, int64_t tokens, int dtype,
                      int num_threads) {
  if (dtype == 1)
    rotate(static_cast<uint16_t*>(x), token_stride, heads, dim, positions, cos_sin, tokens,
           num_threads);
  else
    rotate(static_cast<float*>(x), token_stride, heads, dim, positions, cos_sin, tokens,
           num_threads);
}

void silu_and_mul(const void* x, int64_t rows, int64_t width, int dtype, int num_threads,
                  void* out) {
  if (dtype == 1)
    silu_and_mul(static_cast<const uint16_t*>(x), rows, width, num_threads,
                 static_cast<uint16_t*>(out));
  else
    silu_and_mul(static_cast<const float*>(x), rows, width, num_threads,
                 static_cast<float*>(out));
}

void store_kv(const void* key, const void* value, int64_t key_stride, int64_t value_stride,
              const int64_t* slots, int64_t tokens, int64_t row, int dtype, int num_threads,
              void* k_cache, void* v_cache) {
  if (dtype == 1) {
    store_rows(static_cast<const uint16_t*>(key), key_stride, slots, tokens, row, num_threads,
               static_cast<uint16_t*>(k_cache));
    store_rows(static_cast<const uint16_t*>(value), value_stride, slots, tokens, row, num_threads,
               static_cast<uint16_t*>(v_cache));
  } else {
    store_rows(static_cast<const float*>(key), key_stride, slots, tokens, row, num_threads,
               static_cast<float*>(k_cache));
    store_rows(static_cast<const float*>(value), value_stride, slots, tokens, row, num_threads,
               static_cast<float*>(v_cache));
  }
}

// The KV write into a quantized cache (kernels/kv_quant.py): kv_format 1 int8, 2 fp8 e4m3,
// 3 fp8 e5m2; key and value rows of `heads` x `dim` in `dtype` (0 fp32, 1 bf16).
void store_kv_quantized(const void* key, const void* value, int64_t key_stride,
                        int64_t value_stride, const int64_t* slots, int64_t tokens, int64_t heads,
                        int64_t dim, int dtype, int kv_format, int num_threads, void* k_cache,
                        void* v_cache) {
  if (dtype == 1)
    store_quantized_kv<uint16_t>(key, value, key_stride, value_stride, slots, tokens, heads, dim,
                                 kv_format, num_threads, k_cache, v_cache);
  else
    store_quantized_kv<float>(key, value, key_stride, value_stride, slots, tokens, heads, dim,
                              kv_format, num_threads, k_cache, v_cache);
}
}
