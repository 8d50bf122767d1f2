// What the C++ CPU kernels share: bf16 <-> fp32 as torch rounds, loads and stores of either
// dtype as fp32, and an e^x in plain arithmetic that vectorizes (std::exp does not).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace halfmoon {

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch does
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  const uint32_t rounded = (word + 0x7FFF + ((word >> 16) & 1)) >> 16;
  return static_cast<uint16_t>(value != value ? 0x7FC0 : rounded);  // a select: vectorizes
}

inline float load(const float* row, int64_t i) { return row[i]; }
inline float load(const uint16_t* row, int64_t i) { return bf16_to_float(row[i]); }
inline void store(float* row, int64_t i, float value) { row[i] = value; }
inline void store(uint16_t* row, int64_t i, float value) { row[i] = float_to_bf16(value); }
// A value rounded to T's precision, as torch rounds every op's result in T.
inline float round_as(const float*, float value) { return value; }
inline float round_as(const uint16_t*, float value) { return bf16_to_float(float_to_bf16(value)); }

// A quantized KV cache's rows (kernels/kv_quant.py): `head_dim` 8-bit values, then the row's
// scale in fp16. int8_t rows hold int8 values; these two tags the bytes of the fp8 formats.
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

inline float half_to_float(uint16_t bits) {
  const uint32_t exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    const uint32_t word = ((exponent + 112) << 23) | (mantissa << 13);
    std::memcpy(&value, &word, sizeof(value));
  }
  return bits & 0x8000 ? -value : value;
}

// Every value of an fp8 format, once (a row is read a value at a time only off the vector path).
template <typename F>
inline const float* fp8_table() {
  static const auto table = [] {
    std::array<float, 256> values{};
    for (int b = 0; b < 256; ++b) {
      const bool e4m3 = std::is_same_v<F, fp8_e4m3>;
      const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
      const int exponent = (b & 0x7F) >> mantissa_bits, mantissa = b & ((1 << mantissa_bits) - 1);
      const float magnitude =
          exponent == 0 ? std::ldexp(float(mantissa), 1 - bias - mantissa_bits)
                        : std::ldexp(float(mantissa + (1 << mantissa_bits)),
                                     exponent - bias - mantissa_bits);
      values[b] = b & 0x80 ? -magnitude : magnitude;
    }
    return values;
  }();
  return table.data();
}

inline float load(const int8_t* row, int64_t i) { return row[i]; }
inline float load(const fp8_e4m3* row, int64_t i) { return fp8_table<fp8_e4m3>()[row[i].bits]; }
inline float load(const fp8_e5m2* row, int64_t i) { return fp8_table<fp8_e5m2>()[row[i].bits]; }

// Whether rows of C carry a scale after their values, and that scale (after `dim` values).
template <typename C>
constexpr bool kScaled = std::is_same_v<C, int8_t> || std::is_same_v<C, fp8_e4m3> ||
                         std::is_same_v<C, fp8_e5m2>;
// What a vector load of C (cpu_vector.h) leaves out of its values: e4m3's are read 2^8 too
// small. The plain loads above are exact.
template <typename C>
constexpr float kVectorUnit = std::is_same_v<C, fp8_e4m3> ? 256.0f : 1.0f;

template <typename C>
inline float row_scale(const C* row, int64_t dim) {
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const char*>(row + dim), sizeof(bits));
  return half_to_float(bits);
}

// e^x: 2^k * 2^f with f in [-0.5, 0.5] by a degree-6 polynomial (relative error ~2e-7);
// x clamped to [kExpMin, kExpMax], where e^x is a normal float. cpu_vector.h's vexp is the
// same a vector at a time.
constexpr float kExpMin = -87.0f, kExpMax = 88.0f, kLog2e = 1.44269504f;
constexpr float kExpPoly[7] = {1.5353362e-4f, 1.3398874e-3f, 9.6184197e-3f, 5.5503366e-2f,
                               2.4022649e-1f, 6.9314718e-1f, 1.0f};  // highest power first

inline float fast_exp(float x) {
  x = std::min(std::max(x, kExpMin), kExpMax);
  // Round to nearest by adding and taking away 1.5 * 2^23 (std::nearbyint does not vectorize).
  const float k = (x * kLog2e + 12582912.0f) - 12582912.0f;
  const float f = x * kLog2e - k;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExpPoly[i];
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 1 / d for d in [1, 2^100]: a bit-trick guess refined by three Newton steps (relative error
// ~1e-7), where a vector division takes 10-16 cycles.
inline float reciprocal(float d) {
  uint32_t bits;
  std::memcpy(&bits, &d, sizeof(bits));
  bits = 0x7EF311C3u - bits;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  r = r * (2.0f - d * r);
  r = r * (2.0f - d * r);
  return r * (2.0f - d * r);
}

}  // namespace halfmoon
