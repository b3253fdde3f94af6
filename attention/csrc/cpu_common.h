// Helpers shared by the CPU kernels: bf16/fp16/fp8 -> float, a fixed polynomial exp, and a
// 16-float vector type (GCC vector extensions: one zmm with AVX-512, a pair of 8-float halves
// in ymm registers without it).
// The kernels are built with -ffp-contract=off, so every path performs the same IEEE ops.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline float lane_of(const v16& v, int i) { return v[i]; }
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline u32x16 load_u32x16(const void* p) {
  u32x16 w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}
inline v16 as_v16(u32x16 w) { return (v16)w; }
#else
// Without AVX-512 a 64-byte GCC vector has no register to live in: GCC keeps every such
// variable on the stack and splits each operation into loads, two 8-lane ops and stores (the
// AVX2 build of these kernels ran ~8x slower per layer than the AVX-512 one). Two 8-float
// halves in a struct stay in ymm registers; lane i is lo[i] for i < 8, hi[i - 8] above, and
// every operation is the same per-lane IEEE operation as the 16-lane vector's.
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
struct v16 {
  v8 lo, hi;
};
struct u32x16 {
  u32x8 lo, hi;
};

inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator*(float s, v16 a) { return {s * a.lo, s * a.hi}; }
inline v16 operator*(v16 a, float s) { return {a.lo * s, a.hi * s}; }
inline u32x16 operator<<(u32x16 a, int n) { return {a.lo << n, a.hi << n}; }
inline u32x16 operator&(u32x16 a, uint32_t m) { return {a.lo & m, a.hi & m}; }
inline v16 vmax(v16 a, v16 b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline float lane_of(const v16& v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
// loads and stores by halves: a memcpy of the whole struct went through the stack (GCC 12)
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v.lo, p, sizeof(v8));
  std::memcpy(&v.hi, p + 8, sizeof(v8));
  return v;
}
inline void store16(float* p, v16 v) {
  std::memcpy(p, &v.lo, sizeof(v8));
  std::memcpy(p + 8, &v.hi, sizeof(v8));
}
inline u32x16 load_u32x16(const void* p) {
  u32x16 w;
  std::memcpy(&w.lo, p, sizeof(u32x8));
  std::memcpy(&w.hi, static_cast<const char*>(p) + sizeof(u32x8), sizeof(u32x8));
  return w;
}
inline v16 as_v16(u32x16 w) { return {(v8)w.lo, (v8)w.hi}; }
#endif

// a + s * v rounded once (fused multiply-add) in every lane: the same IEEE operation as the
// scalar std::fma, so vector and scalar paths still agree (-ffp-contract=off only stops the
// compiler from fusing where the source does not ask for it)
#if defined(__AVX512F__)
inline v16 fmadd(float s, v16 v, v16 a) {
  return (v16)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)v, (__m512)a);
}
#elif defined(__FMA__)
inline v16 fmadd(float s, v16 v, v16 a) {
  const __m256 sv = _mm256_set1_ps(s);
  return {(v8)_mm256_fmadd_ps(sv, (__m256)v.lo, (__m256)a.lo),
          (v8)_mm256_fmadd_ps(sv, (__m256)v.hi, (__m256)a.hi)};
}
#else
inline v16 fmadd(float s, v16 v, v16 a) {
  float x[16], y[16];
  store16(x, v);
  store16(y, a);
  for (int l = 0; l < 16; ++l) y[l] = std::fma(s, x[l], y[l]);
  return load16(y);
}
#endif

#if defined(__AVX2__)
// eight bf16 values (16 bytes at p) as floats, exactly
inline __m256 widen_bf16x8(const void* p) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// eight floats as bf16 bits, rounded to nearest even (NaN kept quiet as 0x7FC0), as
// c10::BFloat16 rounds; a value already in bf16 comes back unchanged
inline __m128i narrow_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // lanes 0-3, 0-3, 4-7, 4-7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// rows per thread: enough elements that waking a second thread pays
inline int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, row_elems));
}

inline void check_float(const torch::Tensor& t, const char* what, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf, what, ": ", name,
              " must be float32, bfloat16 or float16");
}

template <typename F>
inline void dispatch(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: f(c10::Half{}); break;
  }
}

}  // namespace
