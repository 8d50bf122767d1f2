// AVX-512 forms of cpu_common.h's helpers, 16 floats at a time, for the kernels' hot loops
// (the loops they replace vectorize, but their horizontal sums, divisions and conversions
// do not compile to the few instructions these use). Each is defined only where the build
// machine has the instructions; the kernels keep their plain loops for the rest.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_common.h"

namespace halfmoon {

#if defined(__AVX512F__)
constexpr int kLanes = 16;

inline __m512 load16(const float* row) { return _mm512_loadu_ps(row); }
inline __m512 load16(const uint16_t* row) {  // bf16 -> fp32: the bits shifted up by 16
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// fast_exp's e^x, lane by lane: the same clamp, split and polynomial; 2^k applied by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_fmsub_ps(x, log2e, k);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, k);
}

// 1 / d: the 14-bit estimate and one Newton step (relative error ~1e-7, as `reciprocal`).
inline __m512 reciprocal16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// fp32 -> bf16, round to nearest even, as torch rounds.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 from_bf16(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void store16(float* row, __m512 v) { _mm512_storeu_ps(row, v); }
inline void store16(uint16_t* row, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), to_bf16(v));
}
// A value rounded to the row type's precision (round_as, 16 lanes).
inline __m512 round16(const float*, __m512 v) { return v; }
inline __m512 round16(const uint16_t*, __m512 v) { return from_bf16(to_bf16(v)); }
#define HALFMOON_VECTOR_BF16 1
#endif

}  // namespace halfmoon
