// Helpers shared by the CPU kernels: bf16/fp16/fp8 -> float, a fixed polynomial exp, and a
// 16-float vector type (GCC vector extensions; one zmm with AVX-512, two ymm with AVX2).
// The kernels are built with -ffp-contract=off, so every path performs the same IEEE ops.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  return __builtin_bit_cast(float, bits);
}

// exp(x) for x <= 0: round-to-nearest range reduction, degree-7 Taylor polynomial, 2^n by
// exponent bits. Relative error ~1e-7; arguments below -87 give exp(-87) (~1.6e-38).
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * 1.44269504088896341f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693145751953125f;  // ln2 high part (exact product for |n| < 2^11)
  r = r - n * 1.428606765330187e-06f;   // ln2 low part
  float p = 1.9841270e-4f;              // 1/5040
  p = p * r + 1.3888889e-3f;            // 1/720
  p = p * r + 8.3333333e-3f;            // 1/120
  p = p * r + 4.1666667e-2f;            // 1/24
  p = p * r + 1.6666667e-1f;            // 1/6
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

typedef float v16 __attribute__((vector_size(64)));

}  // namespace
