// Elementwise steps of a decoder layer, one pass over memory each, for the CPU: RMSNorm (with
// the residual add before it fused in), SwiGLU's SiLU(gate) * up and RoPE of Q and K.
//
// Each output row is computed by the same operations whatever the number of rows or the thread
// that runs it (rows are split between threads whole), so, like the paged-attention kernel,
// they keep a request's results independent of its batch mates. Rounding follows PyTorch's
// reduced-precision ops: every intermediate that PyTorch would store in the model's dtype
// (the residual sum, the normalised row, SiLU's output) is rounded to it here too; arithmetic
// in between is float32.

#include "cpu_common.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// float -> T with round-to-nearest-even (c10's rule), written so loops over it vectorize.
template <typename T>
inline T round_to(float f) {
  return static_cast<T>(f);
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float f) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
  return out;
}

// Sum of squares of v[0, H): 16 lanes accumulated in order of index, then halved pairwise.
inline float sum_squares(const float* v, int64_t H) {
  float lane[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += v[i + l] * v[i + l];
  for (int l = 0; i < H; ++i, ++l) lane[l] += v[i] * v[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// out = weight * round(v / sqrt(mean(v^2) + eps)), v a float32 row.
template <typename T>
inline void norm_row(const float* v, const T* weight, T* out, int64_t H, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(v, H) / static_cast<float>(H) + eps);
  for (int64_t d = 0; d < H; ++d)
    out[d] = round_to<T>(to_float(round_to<T>(v[d] * inv)) * to_float(weight[d]));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1, what,
              ": x must be a contiguous CPU tensor");
  check_float(x, what, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1),
              what, ": weight must be a contiguous [hidden] tensor of x's dtype");
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Eight lanes of the scalar loop below with the same IEEE operations in the same order (no
// fused multiply-add; the exponent's integer is exact), so the bits agree with it: GCC left
// that loop scalar with AVX2 (24 us a [1, 3072] row, a fifth of a one-row step's layer work
// and more with every verified draft); this runs it about 8x faster.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return widen_bf16x8(p); }
inline __m256 round8(__m256 v, float) { return v; }
inline __m256 round8(__m256 v, c10::BFloat16) {  // to bf16 and back, as round_to rounds
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow_bf16x8(v)), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // v already holds bf16 values
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16x8(v));
}
inline __m256 exp_nonpos8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  const __m256 shifter = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter);
  const __m256 n = _mm256_sub_ps(t, shifter);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.9841270e-4f);
  for (const float c : {1.3888889e-3f, 8.3333333e-3f, 4.1666667e-2f, 1.6666667e-1f, 0.5f, 1.0f,
                        1.0f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
// the first I - I % 8 outputs of one row; returns how many it did
template <typename T>
inline int64_t silu_mul8(const T* g, const T* u, T* o, int64_t I) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 x = load8(g + i);
    const __m256 neg = _mm256_cmp_ps(x, zero, _CMP_LT_OQ);
    const __m256 e = exp_nonpos8(_mm256_blendv_ps(_mm256_xor_ps(x, sign), x, neg));
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
    const __m256 s = round8(_mm256_mul_ps(x, sig), T{});
    store8(o + i, round8(_mm256_mul_ps(s, load8(u + i)), T{}));
  }
  return i;
}
template <>
inline int64_t silu_mul8<c10::Half>(const c10::Half*, const c10::Half*, c10::Half*, int64_t) {
  return 0;
}
#else
template <typename T>
inline int64_t silu_mul8(const T*, const T*, T*, int64_t) { return 0; }
#endif

}  // namespace

// RMSNorm over the last dim of a contiguous x [..., H]: weight * round(x / rms(x)).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(H);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t d = 0; d < H; ++d) v[d] = to_float(xp[r * H + d]);
        norm_row(v.data(), wp, op + r * H, H, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// (RMSNorm(residual + x), residual + x), the sum rounded to x's dtype first, as ``x + residual``
// would be.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous, with x's shape and dtype");
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    T* sp = sum.data_ptr<T>();
    at::parallel_for(0, rows, grain(H), [&](int64_t r0, int64_t r1) {
      std::vector<float> v(H);
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = xp + r * H;
        const T* rr = rp + r * H;
        T* sr = sp + r * H;
        for (int64_t d = 0; d < H; ++d) sr[d] = round_to<T>(to_float(rr[d]) + to_float(xr[d]));
        for (int64_t d = 0; d < H; ++d) v[d] = to_float(sr[d]);
        norm_row(v.data(), wp, op + r * H, H, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// SiLU(gate) * up for gate_up [..., 2I] = [gate | up]: returns [..., I]. SiLU(g) = g * sigmoid(g)
// with sigmoid from exp(-|g|) (never overflows), rounded to the dtype before the product.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && gate_up.dim() >= 1 &&
                  gate_up.size(-1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous CPU tensor with an even last dim");
  check_float(gate_up, "silu_mul", "gate_up");
  auto sizes = gate_up.sizes().vec();
  const int64_t I = sizes.back() / 2;
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const int64_t rows = I ? out.numel() / I : 0;
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = gp + r * 2 * I;
        const T* u = g + I;
        T* o = op + r * I;
        for (int64_t i = silu_mul8(g, u, o, I); i < I; ++i) {
          const float x = to_float(g[i]);
          const float e = exp_nonpos(x < 0.0f ? x : -x);
          const float sig = (x < 0.0f ? e : 1.0f) / (1.0f + e);  // one division, either side
          o[i] = round_to<T>(to_float(round_to<T>(x * sig)) * to_float(u[i]));
        }
      }
    });
  });
  return out;
}

// Rotary embedding (rotate-half) of the first nq + nk heads of qkv [N, heads, D] (the QKV
// projection's output: queries, then keys): returns Q [N, nq, D] and K [N, nk, D], contiguous.
// cos/sin [N, D] (any shape of N * D elements) in qkv's dtype, sin's first half negated as
// ``RotaryEmbedding.lookup`` gives it: out = x * cos + swap_halves(x) * sin with each product
// and the sum rounded to the dtype, as those three PyTorch ops would round them. With
// ``q_weight`` / ``k_weight`` ([D], Qwen3's q/k norms) each query / key head is first
// RMS-normalised as ``rms_norm`` does it (rounded to the dtype), so the result has the bits of
// the norm followed by the rotation.
std::tuple<torch::Tensor, torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos,
                                                 torch::Tensor sin, int64_t nq, int64_t nk,
                                                 std::optional<torch::Tensor> q_weight,
                                                 std::optional<torch::Tensor> k_weight,
                                                 double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.stride(2) == 1 &&
                  qkv.stride(1) == qkv.size(2),
              "rope_qk: qkv must be a CPU [N, heads, D] tensor with contiguous heads");
  check_float(qkv, "rope_qk", "qkv");
  const int64_t N = qkv.size(0), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && nq >= 0 && nk >= 0 && nq + nk <= qkv.size(1),
              "rope_qk: need an even head size and nq + nk <= heads");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == N * D &&
                  sin.numel() == N * D,
              "rope_qk: cos and sin must be contiguous, N * D elements, of qkv's dtype");
  for (const auto* w : {&q_weight, &k_weight})
    TORCH_CHECK(!w->has_value() || ((*w)->scalar_type() == qkv.scalar_type() &&
                                    (*w)->is_contiguous() && (*w)->numel() == D),
                "rope_qk: q_weight and k_weight must be contiguous [D] tensors of qkv's dtype");
  auto q = torch::empty({N, nq, D}, qkv.options());
  auto k = torch::empty({N, nk, D}, qkv.options());
  const int64_t row_stride = qkv.stride(0);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const T* qw = q_weight.has_value() ? q_weight->data_ptr<T>() : nullptr;
    const T* kw = k_weight.has_value() ? k_weight->data_ptr<T>() : nullptr;
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, N, grain((nq + nk) * D), [&](int64_t n0, int64_t n1) {
      std::vector<float> v(D);
      std::vector<T> normed(D);
      for (int64_t n = n0; n < n1; ++n) {
        const T* c = cp + n * D;
        const T* s = sp + n * D;
        for (int64_t h = 0; h < nq + nk; ++h) {
          const T* x = xp + n * row_stride + h * D;
          T* o = h < nq ? qp + (n * nq + h) * D : kp + (n * nk + h - nq) * D;
          const T* w = h < nq ? qw : kw;
          if (w != nullptr) {
            for (int64_t d = 0; d < D; ++d) v[d] = to_float(x[d]);
            norm_row(v.data(), w, normed.data(), D, static_cast<float>(eps));
            x = normed.data();
          }
          for (int64_t d = 0; d < half; ++d)
            o[d] = round_to<T>(to_float(round_to<T>(to_float(x[d]) * to_float(c[d]))) +
                               to_float(round_to<T>(to_float(x[d + half]) * to_float(s[d]))));
          for (int64_t d = half; d < D; ++d)
            o[d] = round_to<T>(to_float(round_to<T>(to_float(x[d]) * to_float(c[d]))) +
                               to_float(round_to<T>(to_float(x[d - half]) * to_float(s[d]))));
        }
      }
    });
  });
  return {q, k};
}

// Write the rows of k and v [N, H, D] (last dim contiguous) to their slots of one layer's
// logical cache view [blocks, 2, bs, H, D] (either layout; same dtype as k and v): row n goes
// to (blocks[n], offsets[n]). A plain copy per head row, with no temporary: what the stack and
// index_put of the Python writer do, without their per-call overhead.
void store_kv(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
              torch::Tensor offsets) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.stride(4) == 1,
              "cache must be a [blocks, 2, bs, H, D] view with a contiguous last dim");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [N, H, D] with a contiguous last dim");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k, v and the cache must share a dtype");
  TORCH_CHECK(k.size(1) == cache.size(3) && k.size(2) == cache.size(4), "head shapes differ");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  blocks.is_contiguous() && offsets.is_contiguous() &&
                  blocks.numel() == k.size(0) && offsets.numel() == k.size(0),
              "blocks and offsets must be contiguous int64 [N]");
  const int64_t n = k.size(0), heads = k.size(1);
  const int64_t row_bytes = k.size(2) * k.element_size();
  const int64_t* blk = blocks.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(blk[i] >= 0 && blk[i] < cache.size(0) && off[i] >= 0 && off[i] < cache.size(2),
                "slot (", blk[i], ", ", off[i], ") is outside the cache");
  }
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t es = cache.element_size();
  const int64_t s_blk = cache.stride(0) * es, s_kv = cache.stride(1) * es,
                s_tok = cache.stride(2) * es, s_head = cache.stride(3) * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_row = k.stride(0) * es, k_head = k.stride(1) * es;
  const int64_t v_row = v.stride(0) * es, v_head = v.stride(1) * es;
  for (int64_t i = 0; i < n; ++i) {
    char* dst = base + blk[i] * s_blk + off[i] * s_tok;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * s_head, kp + i * k_row + h * k_head, row_bytes);
      std::memcpy(dst + s_kv + h * s_head, vp + i * v_row + h * v_head, row_bytes);
    }
  }
}
