// Quantizing KV rows into the 8-bit formats of kernels/kv_quant.py, bit for bit as its torch
// reference does: the row's scale (its largest magnitude / the format's largest value, as an
// fp16 no smaller than it), each value divided by it, clamped and rounded to nearest even.
// Used by the KV write of cpu_elementwise.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace halfmoon {

// fp32 -> fp16 bits, rounded to nearest even (overflow to infinity, as a cast does).
inline uint16_t float_to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = (bits >> 16) & 0x8000;
  const uint32_t magnitude = bits & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) return sign | 0x7E00;       // NaN
  if (magnitude >= 0x47800000) return sign | 0x7C00;      // 2^16 and beyond: infinity
  if (magnitude < 0x38800000) {                            // below 2^-14: steps of 2^-24
    float small;
    std::memcpy(&small, &magnitude, sizeof(small));
    return sign | static_cast<uint16_t>(std::nearbyint(small * 16777216.0f));
  }
  const uint32_t rebased = magnitude - 0x38000000;         // exponent bias 127 -> 15
  return sign | static_cast<uint16_t>((rebased + 0xFFF + ((rebased >> 13) & 1)) >> 13);
}

// Rounded to the nearest whole number, ties to even, for |x| < 2^22: adding and taking away
// 1.5 * 2^23 (std::nearbyint does not vectorize).
inline float round_even(float x) { return (x + 12582912.0f) - 12582912.0f; }

template <typename C>
constexpr float kQmax = std::is_same_v<C, int8_t> ? 127.0f : std::is_same_v<C, fp8_e4m3> ? 448.0f
                                                                                         : 256.0f;

// fp32 (within the format's range) -> an fp8 code, rounded to nearest even on the fp32's bits;
// below the smallest normal, a whole number of subnormal steps. Branch-free, so that a row's
// loop vectorizes.
template <int kMantissa, int kBias>
inline uint8_t float_to_fp8(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80;
  const float magnitude = std::fabs(value);
  constexpr float kSmallest = 1.0f / (1 << (kBias - 1));  // 2^(1 - bias)
  constexpr float kSteps = 1 << (kBias - 1 + kMantissa);   // subnormal steps a unit
  const uint32_t subnormal = static_cast<uint32_t>(round_even(magnitude * kSteps));
  constexpr int kShift = 23 - kMantissa;
  const uint32_t rebased = (bits & 0x7FFFFFFF) - (static_cast<uint32_t>(127 - kBias) << 23);
  const uint32_t normal = (rebased + (1u << (kShift - 1)) - 1 + ((rebased >> kShift) & 1)) >> kShift;
  return static_cast<uint8_t>(sign | (magnitude < kSmallest ? subnormal : normal));
}

inline uint8_t encode(int8_t*, float value) {
  return static_cast<uint8_t>(static_cast<int8_t>(round_even(value)));
}
inline uint8_t encode(fp8_e4m3*, float value) { return float_to_fp8<3, 7>(value); }
inline uint8_t encode(fp8_e5m2*, float value) { return float_to_fp8<2, 15>(value); }

// One row of `dim` values (T: fp32 or bf16) as `dim` codes of C and its fp16 scale, into `out`:
// each value times the scale's reciprocal, clamped, rounded.
template <typename C, typename T>
inline void quantize_row(const T* row, int64_t dim, uint8_t* out) {
  constexpr float kLimit = kQmax<C>;
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(load(row, d)));
  uint16_t scale_bits = float_to_half(amax / kLimit);
  if (half_to_float(scale_bits) * kLimit < amax) ++scale_bits;  // no value may clamp
  if (scale_bits == 0) scale_bits = 0x3C00;                        // an all-zero row: 1
  const float inverse = 1.0f / half_to_float(scale_bits);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    const float scaled = std::min(std::max(load(row, d) * inverse, -kLimit), kLimit);
    out[d] = encode(static_cast<C*>(nullptr), scaled);
  }
  std::memcpy(out + dim, &scale_bits, sizeof(scale_bits));
}

}  // namespace halfmoon
