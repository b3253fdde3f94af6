// Batch-invariant paged attention for the CPU.
//
// Every query row is computed by the same sequence of floating-point operations, which depends
// only on that row's query vector, its visible K/V positions (0..n-1 of its request), the head
// size and the cache and query dtypes: not on the batch, the other requests, the request's query
// length or the thread that runs it. So a decode row (q_len = 1) and the same position inside a verify
// block (q_len = K + 1) give bitwise identical outputs, alone or in any batch.
//
// Per row: scores s_j = (q . k_j) * scale for j < n (K read in 16-position blocks, each score
// summed over d in 16 lanes in order, then the lanes in one fixed tree), m = max s,
// p_j = exp(s_j - m) with a fixed polynomial exp, l = sum p_j in 16 fixed lanes,
// o = sum_j p_j v_j in order of j, each term added with one fused multiply-add (fmadd,
// std::fma), out = o / l. Built with -ffp-contract=off so vector and scalar code paths
// perform the same IEEE ops.
//
// Two ways to read K/V, chosen by cache dtype and head size only: bfloat16 pages with a head
// size of 64 or 128 are converted in registers where they are used (and d is visited in a fixed
// permuted order, see bf16x32; with a bfloat16 query and AVX512-BF16 the scores use bfloat16
// dot products, see qk_dot_bf16); every other case converts each 16-position block to a float
// buffer first (load_block).
//
// Tree masks (``AttentionBatch.tree_masks``): a row of a draft tree sees its request's context
// [0, base) plus the query-block offsets set in its mask (its ancestors and itself), and must
// give bitwise what a plain causal row gives over the same K/V stored in logical order (the
// ancestors at base, base + 1, ...). Three facts make that cheap: a score depends only on the
// query and that position's K (every position goes through the same operations: qk_block,
// qk_generic, qk_bf16, qk_dot_bf16 and reduce16 treat all 16 lanes alike); the max is exact,
// so order-free, but the denominator sums in 16 lanes by position mod 16, so positions matter
// there; and P.V adds p_j * v_j in order of j, so exact zeros p_j = 0 interleaved with the
// visible positions change nothing (fma(0, v, a) = a: the accumulator starts at +0 and is
// never -0). So a tree row's scores are computed over its physical extent (base + its
// offset + 1, as a causal row at that offset), compacted into logical order before the
// softmax, which then runs exactly as for a causal row of the logical length, and scattered
// back (zeros at the hidden offsets) for the P.V pass over the physical extent.
//
// Work is split into tasks (request, tile of query positions), each over every kv head, so a
// task sweeps each page's K (then V) of all heads at once (in NHD one run of memory per
// position); when there are too few to busy every thread (a lone decode), one task per kv head.
// A task shares each K/V block between its rows (heads x positions), which changes no row's
// result.

#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;  // K/V positions per block (and lanes of the l sum)


// Sum each of 16 vectors over its 16 lanes in one fixed tree, giving the 16 sums in one vector
// (input kSlot[l]'s sum in lane l, see below). Each stage adds two halves of its inputs: lanes
// 0-7 + 8-15, then within each 8 lanes 0-3 + 4-7, then 0-1 + 2-3, then 0 + 1.
#if defined(__AVX512F__)
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    v16 x = a[2 * i], y = a[2 * i + 1];
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 4; ++i) {
    v16 x = b[2 * i], y = b[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    v16 x = c[2 * i], y = c[2 * i + 1];
    d[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                 31);
}
#else
// The same tree on 8-lane halves: every stage above keeps lanes 0-7 of its result in the low
// halves of its inputs and lanes 8-15 in the high ones (after the first, which folds them).
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = {a[2 * i].lo + a[2 * i].hi, a[2 * i + 1].lo + a[2 * i + 1].hi};
  auto stage2 = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  auto stage3 = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  auto stage4 = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  for (int i = 0; i < 4; ++i)
    c[i] = {stage2(b[2 * i].lo, b[2 * i + 1].lo), stage2(b[2 * i].hi, b[2 * i + 1].hi)};
  for (int i = 0; i < 2; ++i)
    d[i] = {stage3(c[2 * i].lo, c[2 * i + 1].lo), stage3(c[2 * i].hi, c[2 * i + 1].hi)};
  return {stage4(d[0].lo, d[1].lo), stage4(d[0].hi, d[1].hi)};
}
#endif

// kSlot[l]: the input of reduce16 whose sum lands in lane l of its result (its tree of
// half-swaps makes this the 4-bit reversal of l; checked against reduce16 at module load).
constexpr int kSlot[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

bool slots_match_reduce16_impl() {
  v16 a[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    float lanes[kLanes];
    std::fill(lanes, lanes + kLanes, static_cast<float>(l));
    a[l] = load16(lanes);
  }
  const v16 r = reduce16(a);
  for (int e = 0; e < kLanes; ++e)
    if (static_cast<int>(lane_of(r, e)) / kLanes != kSlot[e]) return false;
  return true;
}

// s[0..16) = scale * (q . k_l) for 16 K rows ``stride`` floats apart: each dot product in 16
// lanes summed over d in order, then reduce16's fixed tree. Row l's partial sums are placed
// where reduce16 leaves lane l, so the scores come out in position order.
template <int C>
inline void qk_block(float* __restrict s, const float* __restrict q,
                     const float* __restrict k, int64_t stride, float scale) {
  v16 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + c * kLanes);
  v16 accs[kLanes];
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) {
    const float* kr = k + l * stride;
    v16 a = qv[0] * load16(kr);
    for (int c = 1; c < C; ++c) a = a + qv[c] * load16(kr + c * kLanes);
    accs[kSlot[l]] = a;
  }
  store16(s, reduce16(accs) * scale);
}

inline void qk_generic(float* __restrict s, const float* __restrict q,
                       const float* __restrict k, int64_t stride, int64_t D, float scale) {
  v16 accs[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const float* kr = k + l * stride;
    v16 a = load16(q) * load16(kr);
    for (int64_t c = 1; c < D / kLanes; ++c) a = a + load16(q + c * kLanes) * load16(kr + c * kLanes);
    accs[kSlot[l]] = a;
  }
  store16(s, reduce16(accs) * scale);
}

// acc[0..16C) += sum over l < lmax of p[l] * v[l][0..16C), in order of l, in registers; V's
// rows are ``stride`` floats apart.
template <int C>
inline void pv_block(float* __restrict acc, const float* __restrict p,
                     const float* __restrict v, int64_t lmax, int64_t stride) {
  v16 a[C];
  for (int c = 0; c < C; ++c) a[c] = load16(acc + c * kLanes);
  for (int64_t l = 0; l < lmax; ++l) {
    const float pl = p[l];
    for (int c = 0; c < C; ++c) {
      a[c] = fmadd(pl, load16(v + l * stride + c * kLanes), a[c]);
    }
  }
  for (int c = 0; c < C; ++c) store16(acc + c * kLanes, a[c]);
}

inline void pv_generic(float* __restrict acc, const float* __restrict p,
                       const float* __restrict v, int64_t lmax, int64_t D, int64_t stride) {
  for (int64_t l = 0; l < lmax; ++l) {
    const float pl = p[l];
    for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(pl, v[l * stride + d], acc[d]);
  }
}

struct Geometry {
  const int64_t* tables;
  int64_t table_stride;
  int64_t stride_block, stride_kv, stride_tok, stride_head;
  int64_t block_size;
};

// Address of position j's row of kv head h (K or V).
template <typename T>
inline const T* row_ptr(const T* base, const Geometry& g, const int64_t* table, int64_t h,
                        int which, int64_t j) {
  return base + table[j / g.block_size] * g.stride_block + which * g.stride_kv +
         (j % g.block_size) * g.stride_tok + h * g.stride_head;
}

// Rows of kv head 0 (K or V) of positions j0 .. j0 + 15 that are < n_valid, into ``rows``;
// returns how many. One page lookup when the 16 positions share a page (j0 is a multiple of
// 16, so whenever the block size is too), else one per position: no integer division per row.
template <typename T>
inline int block_rows(const T* base, const Geometry& g, const int64_t* table, int which,
                      int64_t j0, int64_t n_valid, const T** rows) {
  const int n = static_cast<int>(std::min<int64_t>(kLanes, n_valid - j0));
  const int64_t off = j0 % g.block_size;
  if (off + kLanes <= g.block_size) {
    const T* p = base + table[j0 / g.block_size] * g.stride_block + which * g.stride_kv +
                 off * g.stride_tok;
    for (int l = 0; l < n; ++l) rows[l] = p + l * g.stride_tok;
  } else {
    for (int l = 0; l < n; ++l) rows[l] = row_ptr(base, g, table, 0, which, j0 + l);
  }
  return n;
}

// Ask for the rows of positions [j0, j0 + 16) of kv heads [h0, h0 + nh) ahead of their use.
// Always inlined: a separate function holding nothing but prefetches has no side effects as
// far as GCC's interprocedural analysis is concerned, and GCC 12 deleted every call to it
// (no prefetch instruction was left in the built kernel until this attribute; with it, 32
// decode rows over ~300 positions take 0.75-0.8x the time).
template <typename T>
__attribute__((always_inline)) inline void prefetch_block(
    const T* base, const Geometry& g, const int64_t* table, int64_t h0, int64_t nh, int which,
    int64_t j0, int64_t n_valid, int64_t D) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const T* rows[kLanes];
  const int n = block_rows(base, g, table, which, j0, n_valid, rows);
  for (int l = 0; l < n; ++l)
    for (int64_t h = h0; h < h0 + nh; ++h) {
      const char* src = reinterpret_cast<const char*>(rows[l] + h * g.stride_head);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(src + off, 0, 1);
    }
}

// Convert positions [j0, j0 + 16) of kv heads [h0, h0 + nh) to float as [16][nh][D], or, with
// ``transpose``, as [nh][D][16]; positions >= n_valid are zero. In NHD the heads of a position
// are adjacent, so a block of all heads is one run of memory per position.
template <typename T>
inline void load_block(const T* base, const Geometry& g, const int64_t* table, int64_t h0,
                       int64_t nh, int which, int64_t j0, int64_t n_valid, int64_t D,
                       float scale, bool use_scale, bool transpose, float* dst) {
  const T* rows[kLanes];
  const int n = block_rows(base, g, table, which, j0, n_valid, rows);
  for (int l = 0; l < kLanes; ++l) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      if (l >= n) {
        for (int64_t d = 0; d < D; ++d) {
          if (transpose) dst[(hh * D + d) * kLanes + l] = 0.0f; else dst[(l * nh + hh) * D + d] = 0.0f;
        }
        continue;
      }
      const T* src = rows[l] + (h0 + hh) * g.stride_head;
      if (transpose) {
        for (int64_t d = 0; d < D; ++d) {
          float f = to_float(src[d]);
          dst[(hh * D + d) * kLanes + l] = use_scale ? f * scale : f;
        }
      } else {
        float* row = dst + (l * nh + hh) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(src[d]);
        if (use_scale)
          for (int64_t d = 0; d < D; ++d) row[d] = row[d] * scale;
      }
    }
  }
}

// ---- bfloat16 pages, head size 64 or 128: K/V converted in registers, shared by a group ----
//
// A bfloat16 is the top half of a float, so 32 of them loaded as 16 32-bit words give two float
// vectors with one integer op each: word << 16 holds the even-indexed elements, word & 0xffff0000
// the odd-indexed ones. Rows are therefore computed in a fixed permuted order of d (per 32
// elements: the 16 even ones, then the 16 odd ones): the query is stored permuted, scores sum
// over d in that order (a different fixed order than the buffered path, the same for every row),
// and the output is permuted back. The rows of one kv head in a task are computed a group at a
// time, so each K/V row is loaded and converted once per group rather than once per query row.

inline void bf16x32(const c10::BFloat16* src, v16& even, v16& odd) {
  const u32x16 w = load_u32x16(src);
  even = as_v16(w << 16);
  odd = as_v16(w & 0xffff0000u);
}

// A query row as floats in the permuted order (per 32 elements: the even ones, then the odd).
template <typename QT>
inline void permute_row(const QT* src, float* dst, int64_t D) {
  for (int64_t c = 0; c < D; c += 2 * kLanes)
    for (int i = 0; i < kLanes; ++i) {
      dst[c + i] = to_float(src[c + 2 * i]);
      dst[c + kLanes + i] = to_float(src[c + 2 * i + 1]);
    }
}

template <>
inline void permute_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t D) {
  for (int64_t c = 0; c < D; c += 2 * kLanes) {
    v16 even, odd;
    bf16x32(src + c, even, odd);
    store16(dst + c, even);
    store16(dst + c + kLanes, odd);
  }
}

// The inverse of permute_row, dividing by ``l`` on the way out.
template <typename QT>
inline void unpermute_row(const float* src, float l, QT* dst, int64_t D) {
  for (int64_t c = 0; c < D; c += 2 * kLanes)
    for (int i = 0; i < kLanes; ++i) {
      dst[c + 2 * i] = static_cast<QT>(src[c + i] / l);
      dst[c + 2 * i + 1] = static_cast<QT>(src[c + kLanes + i] / l);
    }
}

// Rows per group: their accumulators stay in registers (NR * C of them, plus C for K/V). With
// 16 ymm registers instead of 32 zmm, one row at a time measured fastest (AVX2 build, 32 decode
// rows over 300 positions: 0.87 ms per layer against 0.95 with groups of 4 and 1.1 with 2).
#if defined(__AVX512F__)
constexpr int group_rows(int C) { return C <= 4 ? 4 : 2; }
#else
constexpr int group_rows(int) { return 1; }
#endif

// Scores of NR rows against 16 K rows: per row, each score is 16 lanes summed over (permuted) d
// in order, then reduce16's tree; ``part`` is [NR][16] scratch.
template <int C, int NR>
inline void qk_bf16(float* const* s, const float* const* q, const c10::BFloat16* const* krow,
                    float scale, v16* __restrict part) {
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) {
    v16 k[C];
    for (int c = 0; c < C; c += 2) bf16x32(krow[l] + c * kLanes, k[c], k[c + 1]);
    for (int r = 0; r < NR; ++r) {
      v16 a = load16(q[r]) * k[0];
      for (int c = 1; c < C; ++c) a = a + load16(q[r] + c * kLanes) * k[c];
      part[r * kLanes + kSlot[l]] = a;
    }
  }
  for (int r = 0; r < NR; ++r) {
    store16(s[r], reduce16(part + r * kLanes) * scale);
  }
}

#if defined(__AVX512BF16__)
// With AVX512-BF16 and a bfloat16 query, scores come from bfloat16 dot-product instructions:
// lane i of each 16-lane partial sum adds q[2i] * k[2i] and q[2i + 1] * k[2i + 1] (products of
// two bfloat16 are exact in float) per 32 elements in order of d, then reduce16's tree; no K
// conversion at all. The query row is read as stored (natural order of d).
constexpr bool kBf16Dot = true;

template <int C, int NR>
inline void qk_dot_bf16(float* const* s, const c10::BFloat16* const* q,
                        const c10::BFloat16* const* krow, float scale, v16* __restrict part) {
  constexpr int P = C / 2;  // 32-element vectors per row
  __m512bh qv[NR][P];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < P; ++c) qv[r][c] = (__m512bh)_mm512_loadu_si512(q[r] + 32 * c);
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) {
    __m512bh k[P];
    for (int c = 0; c < P; ++c) k[c] = (__m512bh)_mm512_loadu_si512(krow[l] + 32 * c);
    for (int r = 0; r < NR; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < P; ++c) a = _mm512_dpbf16_ps(a, qv[r][c], k[c]);
      part[r * kLanes + kSlot[l]] = a;
    }
  }
  for (int r = 0; r < NR; ++r) {
    store16(s[r], reduce16(part + r * kLanes) * scale);
  }
}
#else
constexpr bool kBf16Dot = false;
#endif

// acc_r += sum over l < lmax[r] of p_r[l] * v[l] in order of l, for NR rows (permuted d).
template <int C, int NR>
inline void pv_bf16(float* const* acc, const float* const* p, const int64_t* lmax,
                    const c10::BFloat16* const* vrow) {
  v16 a[NR][C];
  int64_t lmax_all = 0;
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = load16(acc[r] + c * kLanes);
    lmax_all = std::max(lmax_all, lmax[r]);
  }
  for (int64_t l = 0; l < lmax_all; ++l) {
    v16 v[C];
    for (int c = 0; c < C; c += 2) bf16x32(vrow[l] + c * kLanes, v[c], v[c + 1]);
    for (int r = 0; r < NR; ++r) {
      if (l >= lmax[r]) continue;
      const float pl = p[r][l];
      for (int c = 0; c < C; ++c) a[r][c] = fmadd(pl, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) store16(acc[r] + c * kLanes, a[r][c]);
}

// Rows of a task are position-major, then kv head, then that head's G query heads; the rows of
// kv head hh still active at block j0 are collected in groups and handed to ``fn(nr, rows)``.
template <int NRMAX, typename Fn>
inline void for_head_groups(int64_t hh, int64_t nh, int64_t G, int64_t rows, int64_t j0,
                            const int64_t* n_of, Fn&& fn) {
  int64_t group[NRMAX];
  int nr = 0;
  for (int64_t r0 = hh * G; r0 < rows; r0 += nh * G)
    for (int64_t g = 0; g < G; ++g) {
      if (j0 >= n_of[r0 + g]) continue;
      group[nr++] = r0 + g;
      if (nr == NRMAX) {
        fn(nr, group);
        nr = 0;
      }
    }
  if (nr) fn(nr, group);
}

// fn(std::integral_constant<int, nr>) for 1 <= nr <= NR: the callee's loops over the rows of
// a group are unrolled, with their accumulators in registers.
template <int NR, typename Fn>
inline void with_rows(int nr, Fn&& fn) {
  switch (nr) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (NR >= 2) fn(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (NR >= 3) fn(std::integral_constant<int, 3>{}); break;
    default: if constexpr (NR >= 4) fn(std::integral_constant<int, 4>{}); break;
  }
}

template <int C>
void score_block_bf16(const c10::BFloat16* cache, const Geometry& geo, const int64_t* table,
                      int64_t h0, int64_t nh, int64_t G, int64_t rows, int64_t j0,
                      int64_t n_max, const int64_t* n_of, const float* qf,
                      const c10::BFloat16* qb, float* scores, int64_t n_pad, float scale,
                      const c10::BFloat16* zero) {
  constexpr int NR = group_rows(C);
  const c10::BFloat16* base[kLanes];
  const int n = block_rows(cache, geo, table, 0, j0, n_max, base);
  v16 part[NR * kLanes];
  for (int64_t hh = 0; hh < nh; ++hh) {
    const c10::BFloat16* krow[kLanes];
    for (int l = 0; l < kLanes; ++l)
      krow[l] = l < n ? base[l] + (h0 + hh) * geo.stride_head : zero;
    for_head_groups<NR>(hh, nh, G, rows, j0, n_of, [&](int nr, const int64_t* group) {
      float* s[NR];
      const float* q[NR];
      for (int i = 0; i < nr; ++i) s[i] = scores + group[i] * n_pad + j0;
#if defined(__AVX512BF16__)
      if (qb != nullptr) {
        const c10::BFloat16* qr[NR];
        for (int i = 0; i < nr; ++i) qr[i] = qb + group[i] * C * kLanes;
        with_rows<NR>(nr, [&](auto n) {
          qk_dot_bf16<C, decltype(n)::value>(s, qr, krow, scale, part);
        });
        return;
      }
#endif
      for (int i = 0; i < nr; ++i) q[i] = qf + group[i] * C * kLanes;
      with_rows<NR>(nr, [&](auto n) {
        qk_bf16<C, decltype(n)::value>(s, q, krow, scale, part);
      });
    });
  }
}

template <int C>
void value_block_bf16(const c10::BFloat16* cache, const Geometry& geo, const int64_t* table,
                      int64_t h0, int64_t nh, int64_t G, int64_t rows, int64_t j0,
                      int64_t n_max, const int64_t* n_of, const float* scores, int64_t n_pad,
                      float* acc) {
  constexpr int NR = group_rows(C);
  const c10::BFloat16* base[kLanes];
  block_rows(cache, geo, table, 1, j0, n_max, base);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const c10::BFloat16* vrow[kLanes];
    // rows past n_max are never read (every lmax stops before them)
    for (int l = 0; l < kLanes && j0 + l < n_max; ++l)
      vrow[l] = base[l] + (h0 + hh) * geo.stride_head;
    for_head_groups<NR>(hh, nh, G, rows, j0, n_of, [&](int nr, const int64_t* group) {
      float* a[NR];
      const float* p[NR];
      int64_t lmax[NR];
      for (int i = 0; i < nr; ++i) {
        a[i] = acc + group[i] * C * kLanes;
        p[i] = scores + group[i] * n_pad + j0;
        lmax[i] = std::min<int64_t>(kLanes, n_of[group[i]] - j0);
      }
      with_rows<NR>(nr, [&](auto n) { pv_bf16<C, decltype(n)::value>(a, p, lmax, vrow); });
    });
  }
}

// A tree row's mask ``m`` (highest set bit: its offset ``i``) on its scores ``sr``, whose
// context is [0, base): move the scores of the set offsets to base, base + 1, ... (logical
// order); returns the logical length.
inline int64_t tree_compact(float* sr, int64_t base, int64_t i, int64_t m) {
  int64_t k = base;
  for (int64_t t = 0; t <= i; ++t)
    if ((m >> t) & 1) sr[k++] = sr[base + t];
  return k;
}

// The inverse, on the probabilities: the k-th set offset t_k gets base + k's value (visiting
// offsets downwards, so nothing is overwritten before it is read: k <= t_k), every other
// offset up to i gets an exact zero.
inline void tree_scatter(float* sr, int64_t base, int64_t i, int64_t m) {
  int64_t k = base + __builtin_popcountll(static_cast<unsigned long long>(m)) - 1;
  for (int64_t t = i; t >= 0; --t) sr[base + t] = (m >> t) & 1 ? sr[k--] : 0.0f;
}

template <typename QT, typename T>
void run(const QT* q, QT* out, const T* cache, const Geometry& geo,
         const int64_t* q_indptr, const int64_t* kv_lens, int64_t num_reqs, int64_t Hq,
         int64_t Hkv, int64_t D, bool causal, float scale, float k_scale, float v_scale,
         bool use_scale, int64_t tile, const int64_t* tree_masks) {
  const int64_t G = Hq / Hkv;
  // bfloat16 pages (no fp8 scale) with a head size of 64 or 128: the register-converting path
  const bool fast = std::is_same_v<T, c10::BFloat16> && (D == 64 || D == 128);
  // ... whose scores use bfloat16 dot products when the query is bfloat16 too and the CPU has them
  const bool dot = fast && kBf16Dot && std::is_same_v<QT, c10::BFloat16>;
  // (query row, position) pairs: tiny calls run on the calling thread. On a quiet 2-core EPYC
  // a second thread already paid from one 220-token decode row of 9 heads (0.023 -> 0.017 ms)
  // and halved 32 such rows (0.71 -> 0.37 ms); the earlier threshold of 64k pairs had been
  // tuned on a machine shared with other jobs, where waking a thread cost more.
  int64_t work = 0;
  for (int64_t b = 0; b < num_reqs; ++b) work += (q_indptr[b + 1] - q_indptr[b]) * kv_lens[b];
  work *= Hq;
  const int64_t max_threads = work < (int64_t{1} << 10) ? 1 : at::get_num_threads();
  // tasks: (request, tile of query positions) pairs, each over all kv heads, so a task reads
  // each page's K (then V) for every head in one sweep. Too few of them to keep every thread
  // busy (a lone decode): one task per kv head instead. Neither changes any row's result.
  std::vector<int64_t> task_req, task_first;
  for (int64_t b = 0; b < num_reqs; ++b) {
    int64_t q_len = q_indptr[b + 1] - q_indptr[b];
    for (int64_t i = 0; i < q_len; i += tile) {
      task_req.push_back(b);
      task_first.push_back(i);
    }
  }
  const int64_t units = static_cast<int64_t>(task_req.size());
  const int64_t head_split = units < 2 * max_threads ? Hkv : 1;
  const int64_t nh = Hkv / head_split;
  const int64_t num_tasks = units * head_split;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min(max_threads, num_tasks)));
  // Dynamic scheduling: tasks differ in cost (context lengths, prefill tiles). Which thread
  // runs a task never changes its result.
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> kblk(kLanes * nh * D), vblk(kLanes * nh * D), qf, scores, acc, denom;
    std::vector<T> zero(D);
    std::vector<c10::BFloat16> qb;
    std::memset(static_cast<void*>(zero.data()), 0, D * sizeof(T));
    std::vector<int64_t> n_of;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t t = task / head_split, h0 = (task % head_split) * nh;
      const int64_t b = task_req[t], i0 = task_first[t];
      const int64_t q_len = q_indptr[b + 1] - q_indptr[b];
      const int64_t kv_len = kv_lens[b];
      const int64_t i1 = std::min(q_len, i0 + tile);
      // row r = ((i - i0) * nh + hh) * G + g: query position i, q head (h0 + hh) * G + g
      const int64_t per_pos = nh * G;
      const int64_t rows = (i1 - i0) * per_pos;
      const int64_t* table = geo.tables + b * geo.table_stride;
      n_of.resize(rows);
      int64_t n_max = 0;
      for (int64_t i = i0; i < i1; ++i) {
        int64_t n = causal ? kv_len - q_len + i + 1 : kv_len;
        for (int64_t k = 0; k < per_pos; ++k) n_of[(i - i0) * per_pos + k] = n;
        n_max = std::max(n_max, n);
      }
      const int64_t n_pad = (n_max + kLanes - 1) / kLanes * kLanes;
      qf.resize(rows * D);
      scores.resize(rows * n_pad);
      acc.resize(rows * D);
      for (int64_t i = i0; i < i1; ++i) {
        const QT* src = q + ((q_indptr[b] + i) * Hq + h0 * G) * D;
        float* dst = qf.data() + (i - i0) * per_pos * D;
        if (dot) {
          if constexpr (std::is_same_v<QT, c10::BFloat16>) {
            qb.resize(rows * D);
            std::memcpy(qb.data() + (i - i0) * per_pos * D, src, per_pos * D * sizeof(QT));
          }
        } else if (fast)
          for (int64_t k = 0; k < per_pos; ++k) permute_row(src + k * D, dst + k * D, D);
        else
          for (int64_t e = 0; e < per_pos * D; ++e) dst[e] = to_float(src[e]);
      }
      // scores, one 16-position block (of every head of the task) at a time
      const bool vec = D % kLanes == 0;
      for (int64_t j0 = 0; j0 < n_max; j0 += kLanes) {
        if (j0 + kLanes < n_max)
          prefetch_block(cache, geo, table, h0, nh, 0, j0 + kLanes, n_max, D);
        else  // the last K block: the V pass starts with V's first block
          prefetch_block(cache, geo, table, h0, nh, 1, 0, n_max, D);
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (fast) {
            if (D == 64)
              score_block_bf16<4>(cache, geo, table, h0, nh, G, rows, j0, n_max, n_of.data(),
                                  qf.data(), dot ? qb.data() : nullptr, scores.data(), n_pad,
                                  scale, zero.data());
            else
              score_block_bf16<8>(cache, geo, table, h0, nh, G, rows, j0, n_max, n_of.data(),
                                  qf.data(), dot ? qb.data() : nullptr, scores.data(), n_pad,
                                  scale, zero.data());
            continue;
          }
        }
        load_block(cache, geo, table, h0, nh, 0, j0, n_max, D, k_scale, use_scale, !vec,
                   kblk.data());
        for (int64_t r = 0; r < rows; ++r) {
          if (j0 >= n_of[r]) continue;
          const int64_t hh = (r / G) % nh;
          const float* qr = qf.data() + r * D;
          float* sr = scores.data() + r * n_pad + j0;
          if (vec) {
            // each score: 16 lanes summed over d in order, then reduce16's fixed tree; position
            // l's partial sums go where reduce16 leaves lane l, so the scores come out in order
            switch (D) {
              case 64: qk_block<4>(sr, qr, kblk.data() + hh * D, nh * D, scale); break;
              case 128: qk_block<8>(sr, qr, kblk.data() + hh * D, nh * D, scale); break;
              default: qk_generic(sr, qr, kblk.data() + hh * D, nh * D, D, scale); break;
            }
            continue;
          }
          float s[kLanes];
          for (int l = 0; l < kLanes; ++l) s[l] = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qr[d];
            const float* kd = kblk.data() + (hh * D + d) * kLanes;
            for (int l = 0; l < kLanes; ++l) s[l] += qd * kd[l];
          }
          for (int l = 0; l < kLanes; ++l) sr[l] = s[l] * scale;
        }
      }
      // softmax numerators and denominators, row by row
      denom.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {
        int64_t n = n_of[r];
        float* sr = scores.data() + r * n_pad;
        // a tree row (not a plain causal one, bits 0..i): softmax in logical order
        int64_t tree = 0, ti = 0;
        if (tree_masks != nullptr) {
          ti = i0 + r / per_pos;
          const int64_t m = tree_masks[q_indptr[b] + ti];
          if (m != 0 && static_cast<uint64_t>(m) != (uint64_t{2} << ti) - 1) {
            tree = m;
            n = tree_compact(sr, kv_len - q_len, ti, m);
          }
        }
        // the maximum in 16 lanes, then across them: max is exact, so the order is free
        float m = sr[0];
        if (n >= kLanes) {
          v16 mv = load16(sr);
          int64_t j = kLanes;
          for (; j + kLanes <= n; j += kLanes) {
            mv = vmax(load16(sr + j), mv);
          }
          for (int l = 0; l < kLanes; ++l) m = lane_of(mv, l) > m ? lane_of(mv, l) : m;
          for (; j < n; ++j) m = sr[j] > m ? sr[j] : m;
        } else {
          for (int64_t j = 1; j < n; ++j) m = sr[j] > m ? sr[j] : m;
        }
        for (int64_t j = 0; j < n; ++j) sr[j] = exp_nonpos(sr[j] - m);
        for (int64_t j = n; j < n_pad; ++j) sr[j] = 0.0f;
        float lane[kLanes];
        for (int l = 0; l < kLanes; ++l) lane[l] = 0.0f;
        for (int64_t j0 = 0; j0 < n_pad; j0 += kLanes)
          for (int l = 0; l < kLanes; ++l) lane[l] += sr[j0 + l];
        for (int w = kLanes / 2; w >= 1; w /= 2)
          for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
        denom[r] = lane[0];
        if (tree) tree_scatter(sr, kv_len - q_len, ti, tree);
      }
      // weighted sum of V in order of position
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t vstride = nh * D;
      for (int64_t j0 = 0; j0 < n_max; j0 += kLanes) {
        if (j0 + kLanes < n_max) {
          prefetch_block(cache, geo, table, h0, nh, 1, j0 + kLanes, n_max, D);
        } else {  // the last V block: the next tasks (either thread's) start with K's first
          for (int64_t next = task + 1; next <= task + 2 && next < num_tasks; ++next) {
            const int64_t tn = next / head_split, hn = (next % head_split) * nh;
            const int64_t bn = task_req[tn];
            prefetch_block(cache, geo, geo.tables + bn * geo.table_stride, hn, nh, 0, 0,
                           kv_lens[bn], D);
          }
        }
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (fast) {
            if (D == 64)
              value_block_bf16<4>(cache, geo, table, h0, nh, G, rows, j0, n_max, n_of.data(),
                                  scores.data(), n_pad, acc.data());
            else
              value_block_bf16<8>(cache, geo, table, h0, nh, G, rows, j0, n_max, n_of.data(),
                                  scores.data(), n_pad, acc.data());
            continue;
          }
        }
        load_block(cache, geo, table, h0, nh, 1, j0, n_max, D, v_scale, use_scale, false,
                   vblk.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = n_of[r];
          if (j0 >= n) continue;
          const int64_t lmax = std::min<int64_t>(kLanes, n - j0);
          const float* pr = scores.data() + r * n_pad + j0;
          const float* vr = vblk.data() + ((r / G) % nh) * D;
          float* ar = acc.data() + r * D;
          switch (D) {
            case 64: pv_block<4>(ar, pr, vr, lmax, vstride); break;
            case 128: pv_block<8>(ar, pr, vr, lmax, vstride); break;
            default: pv_generic(ar, pr, vr, lmax, D, vstride); break;
          }
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        QT* dst = out + ((q_indptr[b] + i) * Hq + h0 * G) * D;
        for (int64_t k = 0; k < per_pos; ++k) {
          const int64_t r = (i - i0) * per_pos + k;
          const float* ar = acc.data() + r * D;
          const float l = denom[r];
          if (fast)
            unpermute_row(ar, l, dst + k * D, D);
          else
            for (int64_t d = 0; d < D; ++d) dst[k * D + d] = static_cast<QT>(ar[d] / l);
        }
      }
    }
  }
}

}  // namespace

// q [N, Hq, D] float32, bfloat16 or float16; cache: one layer's logical view [blocks, 2, bs, Hkv, D] (any strides,
// last dim contiguous); block_tables [B, M] int64; q_indptr [B+1] int64; kv_lens [B] int64.
// Returns [N, Hq, D] in q's dtype (computed in float32, rounded once at the end).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                              torch::Tensor q_indptr, torch::Tensor kv_lens, bool causal,
                              double scale, double k_scale, double v_scale, int64_t tile,
                              std::optional<torch::Tensor> tree_masks) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
                   q.scalar_type() == at::kHalf),
              "q must be a contiguous float32/bfloat16/float16 [N, Hq, D] tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.stride(4) == 1,
              "cache must be a [blocks, 2, bs, Hkv, D] view with a contiguous last dim");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(), "block_tables must be contiguous int64 [B, M]");
  TORCH_CHECK(q_indptr.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  q_indptr.is_contiguous() && kv_lens.is_contiguous(),
              "q_indptr and kv_lens must be contiguous int64");
  TORCH_CHECK(tile >= 1, "tile must be >= 1");
  const int64_t B = kv_lens.size(0);
  TORCH_CHECK(q_indptr.size(0) == B + 1 && block_tables.size(0) == B, "batch sizes disagree");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = cache.size(3);
  TORCH_CHECK(cache.size(4) == D, "head size of q and cache differ");
  TORCH_CHECK(Hq % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t* qi = q_indptr.data_ptr<int64_t>();
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  TORCH_CHECK(qi[B] == q.size(0), "q_indptr does not cover q");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qi[b + 1] - qi[b];
    TORCH_CHECK(q_len >= 0 && kl[b] >= 1 && kl[b] >= q_len, "request ", b,
                ": need kv_len >= max(1, q_len), got q_len ", q_len, " kv_len ", kl[b]);
    TORCH_CHECK((kl[b] + cache.size(2) - 1) / cache.size(2) <= block_tables.size(1),
                "request ", b, ": block table too short for kv_len ", kl[b]);
  }
  // tree masks (see AttentionBatch.tree_masks): per packed query row, 0 (causal) or the row's
  // visible query-block offsets as bits, the highest one the row's own offset
  const int64_t* tm = nullptr;
  if (tree_masks.has_value() && tree_masks->defined()) {
    const torch::Tensor& t = *tree_masks;
    TORCH_CHECK_VALUE(causal, "tree masks need causal attention");
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() &&
                    t.device().is_cpu() && t.size(0) == q.size(0),
                "tree_masks must be a contiguous int64 host tensor of ", q.size(0),
                " entries (one per query row)");
    tm = t.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q_len = qi[b + 1] - qi[b];
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t m = tm[qi[b] + i];
        if (m == 0) continue;
        TORCH_CHECK_VALUE(q_len <= 63, "tree masks: request ", b, " has q_len ", q_len,
                          " > 63");
        TORCH_CHECK_VALUE((m >> i) == 1, "tree masks: request ", b, ", query row ", i,
                          ": mask ", m, " has its highest set bit at ",
                          63 - __builtin_clzll(static_cast<unsigned long long>(m)),
                          ", must be the row's own offset ", i);
      }
    }
  }
  auto out = torch::empty_like(q);
  Geometry geo{block_tables.data_ptr<int64_t>(), block_tables.size(1), cache.stride(0),
               cache.stride(1), cache.stride(2), cache.stride(3), cache.size(2)};
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn ||
                   cache.scalar_type() == at::kFloat8_e5m2;
  const bool use_scale = fp8 && (k_scale != 1.0 || v_scale != 1.0);
  auto go = [&](auto* ptr) {
    auto with_q = [&](auto* qp, auto* op) {
      run(qp, op, ptr, geo, qi, kl, B, Hq, Hkv, D, causal, static_cast<float>(scale),
          static_cast<float>(k_scale), static_cast<float>(v_scale), use_scale, tile, tm);
    };
    switch (q.scalar_type()) {
      case at::kFloat: with_q(q.data_ptr<float>(), out.data_ptr<float>()); break;
      case at::kBFloat16:
        with_q(q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>()); break;
      default: with_q(q.data_ptr<c10::Half>(), out.data_ptr<c10::Half>()); break;
    }
  };
  switch (cache.scalar_type()) {
    case at::kFloat: go(cache.data_ptr<float>()); break;
    case at::kBFloat16: go(cache.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: go(cache.data_ptr<c10::Half>()); break;
    case at::kFloat8_e4m3fn: go(cache.data_ptr<c10::Float8_e4m3fn>()); break;
    case at::kFloat8_e5m2: go(cache.data_ptr<c10::Float8_e5m2>()); break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", cache.scalar_type());
  }
  return out;
}

bool paged_attention_self_check() { return slots_match_reduce16_impl(); }
