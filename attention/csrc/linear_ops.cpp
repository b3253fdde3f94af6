// y = x W^T (+ b) for bfloat16 weights on CPUs whose oneDNN has no native bf16 product (AVX2
// with FMA and no AVX512_BF16): PyTorch then converts the weight on every call and runs
// float32 kernels, slower than float32 itself from a few rows on. Here the weight is packed
// once into panels of 16 output columns, read as bf16 (half the bytes of float32: one-row
// decoding is bound by how fast the weights stream from memory) and widened in registers.
//
// Every output element is one chain of fused multiply-adds over the input dimension in order,
// starting from zero, then the bias added and the sum rounded to bf16 (to nearest, ties to
// even). Nothing in that chain depends on how many rows the call has, which rows are tiled
// together or how the columns are split between threads: a row comes out bitwise the same
// however it is batched, which is what lets a token verified among drafts be scored exactly as
// it would be decoded alone.

#include "cpu_common.h"

#include <ATen/Parallel.h>

namespace {

constexpr int64_t kCols = 16;   // output columns per panel
constexpr int64_t kRowTile = 6;  // rows per register tile (12 accumulators + 2 weights + 1)
constexpr int64_t kRowChunk = 48;  // rows whose activations stay in L2 while panels pass by

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvailable = true;

// Rows [0, MR) of x (stride ldx) times NB consecutive panels (each [K][16] bf16, panel stride
// K*16) into acc [MR][NB*16].
template <int MR, int NB>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t K, float* acc) {
  __m256 a[MR][2 * NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NB; ++j) a[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NB];
    for (int b = 0; b < NB; ++b) {
      const uint16_t* p = w + b * K * kCols + k * kCols;
      wv[2 * b] = widen_bf16x8(p);
      wv[2 * b + 1] = widen_bf16x8(p + 8);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      for (int j = 0; j < 2 * NB; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(acc + r * NB * kCols + j * 8, a[r][j]);
}
// acc rows [MR][NB*16] for columns n0.. of y (width N) plus bias, rounded to bf16
template <int MR, int NB>
inline void store(const float* acc, const float* bias, uint16_t* y, int64_t ldy, int64_t n0,
                  int64_t N) {
  for (int r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < NB * kCols; c += 8) {
      const int64_t n = n0 + c;
      if (n >= N) break;
      float v[8];
      std::memcpy(v, acc + r * NB * kCols + c, sizeof(v));
      if (bias != nullptr)
        for (int l = 0; l < 8 && n + l < N; ++l) v[l] = v[l] + bias[n + l];
      uint16_t out[8];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), narrow_bf16x8(_mm256_loadu_ps(v)));
      std::memcpy(y + r * ldy + n, out, sizeof(uint16_t) * std::min<int64_t>(8, N - n));
    }
  }
}

template <int MR, int NB>
inline void run_tile(const float* x, int64_t K, const uint16_t* panels, int64_t panel,
                     const float* bias, uint16_t* y, int64_t N) {
  alignas(32) float acc[MR * NB * kCols];
  tile<MR, NB>(x, K, panels + panel * K * kCols, K, acc);
  store<MR, NB>(acc, bias, y, N, panel * kCols, N);
}

// rows [m, m + mr) of one panel, mr in 1..kRowTile
inline void run_rows(const float* x, int64_t mr, int64_t K, const uint16_t* panels,
                     int64_t panel, const float* bias, uint16_t* y, int64_t N) {
  switch (mr) {
    case 1: run_tile<1, 1>(x, K, panels, panel, bias, y, N); break;
    case 2: run_tile<2, 1>(x, K, panels, panel, bias, y, N); break;
    case 3: run_tile<3, 1>(x, K, panels, panel, bias, y, N); break;
    case 4: run_tile<4, 1>(x, K, panels, panel, bias, y, N); break;
    case 5: run_tile<5, 1>(x, K, panels, panel, bias, y, N); break;
    default: run_tile<6, 1>(x, K, panels, panel, bias, y, N); break;
  }
}

#else
constexpr bool kAvailable = false;
#endif

// -- AVX512_BF16: pairs of bf16 products summed in one instruction (vdpbf16ps) -------------
// The weight is packed into panels of 16 output columns, each as [K/2][16] 32-bit lanes
// holding two consecutive inputs' weights (the lower input in the low half), so one load feeds
// one vdpbf16ps per row. The activations need no widening: a row's bf16 pairs are broadcast as
// they lie in memory. An output element is one chain of vdpbf16ps over the input pairs in
// order, starting from zero, then the bias added in float and the sum rounded to bf16 (to
// nearest, ties to even): as with the AVX2 panels, no row's bits depend on the row count, the
// tiling or the thread split.
constexpr int64_t kDpGroup = 8;  // panels a packed weight is padded to a multiple of
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kDpAvailable = true;

// Rows [0, MR) of x (pairs, stride ldx) times panels [0, NB) (panel stride Kp*16) into acc.
template <int MR, int NB>
inline void dp_tile(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t Kp, float* acc) {
  __m512 a[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kp; ++kp) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + (b * Kp + kp) * kCols);
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[r * ldx + kp]));
      for (int b = 0; b < NB; ++b)
        a[r][b] = _mm512_dpbf16_ps(a[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(acc + (r * NB + b) * kCols, a[r][b]);
}

// rows [0, MR) of x times panels [p0, p0 + NB) into y (width N, bias added, rounded to bf16)
template <int MR, int NB>
inline void dp_run(const uint32_t* x, int64_t Kp, const uint32_t* w, int64_t p0, int64_t P,
                   const float* bias, uint16_t* y, int64_t N) {
  alignas(64) float acc[MR * NB * kCols];
  dp_tile<MR, NB>(x, Kp, w + p0 * Kp * kCols, Kp, acc);
  for (int b = 0; b < NB && p0 + b < P; ++b) {
    const int64_t n0 = (p0 + b) * kCols, width = std::min<int64_t>(kCols, N - n0);
    alignas(64) float bb[kCols] = {0.0f};
    if (bias != nullptr) std::memcpy(bb, bias + n0, sizeof(float) * width);
    const __m512 bv = _mm512_load_ps(bb);
    for (int r = 0; r < MR; ++r) {
      __m512 v = _mm512_loadu_ps(acc + (r * NB + b) * kCols);
      if (bias != nullptr) v = _mm512_add_ps(v, bv);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      if (width == kCols) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + n0), h);
      } else {
        alignas(32) uint16_t t[kCols];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), h);
        std::memcpy(y + r * N + n0, t, sizeof(uint16_t) * width);
      }
    }
  }
}
#else
constexpr bool kDpAvailable = false;
#endif

}  // namespace

bool bf16_linear_available() { return kAvailable; }

// weight [N, K] bf16 -> panels [ceil(N/16), K, 16] bf16 (columns past N zero)
torch::Tensor bf16_linear_pack(torch::Tensor weight) {
  TORCH_CHECK(kAvailable, "bf16_linear_pack: built without AVX2 and FMA");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              "bf16_linear_pack: weight must be a 2-D bfloat16 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols;
  auto padded = torch::zeros({panels * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kCols, K}).transpose(1, 2).contiguous();
}

// x [..., K] bf16 times the packed weight of N outputs, plus bias [N] (bf16): [..., N] bf16
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                          std::optional<torch::Tensor> bias) {
  TORCH_CHECK(kAvailable, "bf16_linear: built without AVX2 and FMA");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be a bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(0) * kCols >= N &&
                  packed.size(0) * kCols < N + kCols,
              "bf16_linear: packed must come from bf16_linear_pack for ", N, " outputs");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "bf16_linear: x has ", x.size(-1), " inputs, the weight ", K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const int64_t M = x.numel() / K;
  if (M == 0) return y;
#if defined(__AVX2__) && defined(__FMA__)
  // the activations widened once (exact), so the tiles broadcast floats
  auto xf = x.contiguous().view({M, K}).to(at::kFloat);
  std::optional<torch::Tensor> bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias must have ", N, " elements");
    bf = bias->contiguous().to(at::kFloat);
  }
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.has_value() ? bf->data_ptr<float>() : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panels = packed.size(0);
  // one-row and two-row calls stream the weights: three or two panels a tile keep six or
  // eight multiply-add chains in flight; larger calls take six rows a tile, one panel each
  const int64_t group = M == 1 ? 3 : M == 2 ? 2 : 1;
  const int64_t groups = (panels + group - 1) / group;
  const int64_t per_panel = M * K * kCols;  // multiply-adds of one panel
  const int64_t grain_groups = std::max<int64_t>(1, (int64_t{1} << 17) / (per_panel * group));
  at::parallel_for(0, groups, grain_groups, [&](int64_t g0, int64_t g1) {
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c1 = std::min(M, c0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * group, p1 = std::min(panels, p0 + group);
        // the chunk's rows in tiles of as even a size as six allows (eight rows as 4 + 4, not
        // 6 + 2: a two-row tile's four chains would wait on each multiply-add's latency)
        const int64_t tiles = (c1 - c0 + kRowTile - 1) / kRowTile;
        for (int64_t t = 0, m = c0; t < tiles; ++t) {
          const int64_t mr = (c1 - m + (tiles - t) - 1) / (tiles - t);
          const float* xm = xp + m * K;
          uint16_t* ym = yp + m * N;
          m += mr;
          if (p1 - p0 == 3 && mr == 1) {
            run_tile<1, 3>(xm, K, wp, p0, bp, ym, N);
          } else if (p1 - p0 == 2 && mr == 1) {
            run_tile<1, 2>(xm, K, wp, p0, bp, ym, N);
          } else if (p1 - p0 == 2 && mr == 2) {
            run_tile<2, 2>(xm, K, wp, p0, bp, ym, N);
          } else {
            for (int64_t p = p0; p < p1; ++p) run_rows(xm, mr, K, wp, p, bp, ym, N);
          }
        }
      }
    }
  });
#endif
  return y;
}

bool bf16_dp_linear_available() { return kDpAvailable; }

// weight [N, K] bf16 -> [ceil(N/16) rounded up to 8, ceil(K/2), 16] int32 lanes, each two
// consecutive inputs' weights (padding zero)
torch::Tensor bf16_dp_linear_pack(torch::Tensor weight) {
  TORCH_CHECK(kDpAvailable, "bf16_dp_linear_pack: built without AVX512_BF16");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              "bf16_dp_linear_pack: weight must be a 2-D bfloat16 CPU tensor");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 1) / 2;
  const int64_t P = (N + kCols - 1) / kCols, padded = (P + kDpGroup - 1) / kDpGroup * kDpGroup;
  auto out = torch::zeros({padded, Kp, kCols}, at::kInt);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* op = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t p = n / kCols, lane = n % kCols;
      for (int64_t kp = 0; kp < Kp; ++kp) {
        const uint32_t lo = wp[n * K + 2 * kp];
        const uint32_t hi = 2 * kp + 1 < K ? wp[n * K + 2 * kp + 1] : 0u;
        op[(p * Kp + kp) * kCols + lane] = lo | (hi << 16);
      }
    }
  });
  return out;
#else
  return weight;
#endif
}

torch::Tensor bf16_dp_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                             std::optional<torch::Tensor> bias) {
  TORCH_CHECK(kDpAvailable, "bf16_dp_linear: built without AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "bf16_dp_linear: x must be a bfloat16 CPU tensor");
  const int64_t K = x.size(-1), Kp = (K + 1) / 2, P = (N + kCols - 1) / kCols;
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == Kp && packed.size(2) == kCols &&
                  packed.is_contiguous() && packed.scalar_type() == at::kInt &&
                  packed.size(0) >= P && packed.size(0) % kDpGroup == 0 && P > 0,
              "bf16_dp_linear: packed must come from bf16_dp_linear_pack for ", N,
              " outputs and ", K, " inputs");
  TORCH_CHECK(K % 2 == 0, "bf16_dp_linear: an odd number of inputs (", K, ")");
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const int64_t M = x.numel() / K;
  if (M == 0) return y;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  auto xc = x.contiguous();
  std::optional<torch::Tensor> bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bf16_dp_linear: bias must have ", N, " elements");
    bf = bias->contiguous().to(at::kFloat);
  }
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const float* bp = bf.has_value() ? bf->data_ptr<float>() : nullptr;
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // one row streams the weights through eight panels at a time (as many independent chains);
  // more rows go in tiles of up to six rows over four panels (24 accumulators: 4 weight loads
  // and up to 6 broadcasts feed 24 pair products), the panels staying in L2 while a chunk of
  // rows passes
  const int64_t group = M == 1 ? 8 : 4;
  const int64_t groups = (P + group - 1) / group;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (M * Kp * kCols * group));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c1 = std::min(M, c0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p0 = g * group;
        if (M == 1) {
          dp_run<1, 8>(xp, Kp, wp, p0, P, bp, yp, N);
          continue;
        }
        // the chunk's rows in tiles of as even a size as six allows
        const int64_t tiles = (c1 - c0 + kRowTile - 1) / kRowTile;
        for (int64_t t = 0, m = c0; t < tiles; ++t) {
          const int64_t mr = (c1 - m + (tiles - t) - 1) / (tiles - t);
          const uint32_t* xm = xp + m * Kp;
          uint16_t* ym = yp + m * N;
          m += mr;
          switch (mr) {
            case 1: dp_run<1, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
            case 2: dp_run<2, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
            case 3: dp_run<3, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
            case 4: dp_run<4, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
            case 5: dp_run<5, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
            default: dp_run<6, 4>(xm, Kp, wp, p0, P, bp, ym, N); break;
          }
        }
      }
    }
  });
#endif
  return y;
}
