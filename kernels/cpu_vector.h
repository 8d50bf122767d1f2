// cpu_common.h's helpers on whole vectors, for the kernels' hot loops: 16 floats a vector where
// the build targets AVX-512 (the `avx512*` and `amx` variants of cpu_build.py), 8 where it
// targets AVX2 and FMA (`avx2`). The same names on either width, so a kernel is written once:
// `vfloat`, `kLanes`, vload / vstore (fp32, or bf16 widened and rounded as torch rounds),
// arithmetic, sums, e^x and 1 / d. HALFMOON_VEC is defined (512 or 256) where they exist; a
// kernel keeps its plain loops for the `generic` variant and for each row's tail.
#pragma once

#include <cstdint>

#include "cpu_common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace halfmoon {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define HALFMOON_VEC 512
using vfloat = __m512;
constexpr int kLanes = 16;
constexpr int kRegisters = 32;

inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* row) { return _mm512_loadu_ps(row); }
inline vfloat from_bf16(__m256i half) {  // bf16 -> fp32: the bits shifted up by 16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline vfloat vload(const uint16_t* row) {
  return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
}
// 8-bit KV values (cpu_common.h), 16 a vector: int8 widened; an fp8 byte placed in an fp16's
// bits and converted. e5m2 is an fp16's top byte; e4m3's byte, sign-extended and shifted 7
// bits up with the shifted sign bit cleared, puts its exponent and mantissa where an fp16's
// low exponent bits and mantissa are: read 2^8 too small (kVectorUnit), which the kernels fold
// into the row's scale.
inline vfloat vload(const int8_t* row) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)row)));
}
inline __m256i load_bytes16(const void* row) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(row)));
}
inline vfloat vload(const fp8_e5m2* row) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(load_bytes16(row), 8));
}
inline vfloat vload(const fp8_e4m3* row) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)row));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(0xBF80)));
}
inline void vstore(float* row, vfloat v) { _mm512_storeu_ps(row, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vfmsub(vfloat a, vfloat b, vfloat c) { return _mm512_fmsub_ps(a, b, c); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vlargest(vfloat v) { return _mm512_reduce_max_ps(v); }
inline vfloat vround_even(vfloat v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline vfloat vscale_pow2(vfloat p, vfloat k) { return _mm512_scalef_ps(p, k); }  // p * 2^k
// The first n (0-16) lanes of v to row.
inline void vstore_first(float* row, vfloat v, int n) {
  _mm512_mask_storeu_ps(row, static_cast<__mmask16>((1u << n) - 1), v);
}
// 1 / d: the 14-bit estimate and one Newton step (relative error ~1e-7, as `reciprocal`).
inline vfloat vreciprocal(vfloat d) {
  const vfloat r = _mm512_rcp14_ps(d);
  return vmul(r, _mm512_fnmadd_ps(d, r, vset(2.0f)));
}

// fp32 -> bf16, rounded to nearest even as torch rounds.
#if defined(__AVX512BF16__)
inline __m256i to_bf16(vfloat v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
inline __m256i to_bf16(vfloat v) {  // float_to_bf16 lane by lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
#endif
inline void vstore(uint16_t* row, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), to_bf16(v));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define HALFMOON_VEC 256
using vfloat = __m256;
constexpr int kLanes = 8;
constexpr int kRegisters = 16;

inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* row) { return _mm256_loadu_ps(row); }
inline vfloat from_bf16(__m128i half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline vfloat vload(const uint16_t* row) {
  return from_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
}
// 8-bit KV values, 8 a vector, as on AVX-512 above (F16C converts the fp16s; e4m3 read 2^8 too
// small).
inline vfloat vload(const int8_t* row) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)row)));
}
inline __m128i load_bytes8(const void* row) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(row)));
}
inline vfloat vload(const fp8_e5m2* row) {
  return _mm256_cvtph_ps(_mm_slli_epi16(load_bytes8(row), 8));
}
inline vfloat vload(const fp8_e4m3* row) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)row));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(0xBF80)));
}
inline void vstore(float* row, vfloat v) { _mm256_storeu_ps(row, v); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vfmsub(vfloat a, vfloat b, vfloat c) { return _mm256_fmsub_ps(a, b, c); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
inline float vlargest(vfloat v) {
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}
inline vfloat vround_even(vfloat v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^k for whole k in [-126, 127] (fast_exp's range): 2^k built from its exponent bits.
inline vfloat vscale_pow2(vfloat p, vfloat k) {
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return vmul(p, _mm256_castsi256_ps(bits));
}
inline void vstore_first(float* row, vfloat v, int n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(row, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
}
// 1 / d: the 12-bit estimate and one Newton step (relative error ~2e-7).
inline vfloat vreciprocal(vfloat d) {
  const vfloat r = _mm256_rcp_ps(d);
  return vmul(r, _mm256_fnmadd_ps(d, r, vset(2.0f)));
}

inline __m128i to_bf16(vfloat v) {  // float_to_bf16 lane by lane
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is below 2^16, so packing with unsigned saturation keeps it exactly.
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
inline void vstore(uint16_t* row, vfloat v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(row), to_bf16(v));
}
#endif

#if defined(HALFMOON_VEC)
// fast_exp's e^x, lane by lane: the same clamp, split and polynomial.
inline vfloat vexp(vfloat x) {
  x = vmin(vmax(x, vset(kExpMin)), vset(kExpMax));
  const vfloat log2e = vset(kLog2e);
  const vfloat k = vround_even(vmul(x, log2e));
  const vfloat f = vfmsub(x, log2e, k);
  vfloat p = vset(kExpPoly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 7; ++i) p = vfmadd(p, f, vset(kExpPoly[i]));
  return vscale_pow2(p, k);
}

// A value rounded to the row type's precision (round_as, a vector at a time).
inline vfloat vround_as(const float*, vfloat v) { return v; }
inline vfloat vround_as(const uint16_t*, vfloat v) { return from_bf16(to_bf16(v)); }
#endif

}  // namespace halfmoon
