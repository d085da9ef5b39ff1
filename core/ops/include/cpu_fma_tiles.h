// A matmul in fp32 FMA register tiles: out = x @ W.T (+ bias) for any row count, x in
// fp32, the weight in fp32 or bf16 (widened to fp32 in registers: products and sums in
// fp32), the output fp32 or bf16 (rounded to nearest even). Built on the widest vectors
// the compiler targets: 16 floats where AVX-512F is there, else 8 on AVX2 + FMA
// (PLUGSERVE_HAS_FMA_TILES; kLanes says which).
//
// The weight is packed once (pack_panels) into panels of two vectors' columns,
// [N/kPanel][K][kPanel], zero past N, so that one k of a panel is two vectors. A tile of
// up to kTileRows rows x kPanel columns keeps its sums in registers over the whole K: per
// k, the panel's two vectors and one broadcast of x per row feed two FMAs per row. One and
// two rows split k over chains, so that a decode step is bound by reading the panel, not
// by the FMA's latency. Each tile of three rows or more prefetches its share of the next
// panel, which then streams in from memory under this one's FMAs.
//
// Why a bf16 weight is worth widening where AVX512_BF16 exists: on some CPUs the fp32 FMA
// outruns VDPBF16PS (docs/benchmarks-history.md, "bf16 on fp32 FMA tiles"), and the
// kernel chooser measures which is faster.
//
// Work items are (panel, group of rows): a thread keeps one panel in its caches while the
// tiles of its rows run over it; the groups vary fastest, so a thread's share of the items
// is whole panels, each read once for all its rows.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PLUGSERVE_HAS_FMA_TILES 1
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include "cpu_vec_math.h"
#endif

namespace plugserve::fma {

#if defined(__AVX512F__)

using Vec = __m512;
constexpr int64_t kLanes = 16;
// 24 sums, two panel vectors and a broadcast: 27 of the 32 vector registers.
constexpr int64_t kTileRows = 12;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
// One k of a panel as its two vectors: fp32 as it lies; bf16 from one load of 32 values
// that pack_panels interleaved (column j beside column j + 16), each widened by one
// instruction (a bf16's bits are an fp32's high half).
inline void load_panel_row(const float* w, Vec& lo, Vec& hi) {
  lo = _mm512_loadu_ps(w);
  hi = _mm512_loadu_ps(w + kLanes);
}
inline void load_panel_row(const uint16_t* w, Vec& lo, Vec& hi) {
  const __m512i pairs = _mm512_loadu_si512(w);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
inline __mmask16 first_lanes(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff)
         : count <= 0    ? static_cast<__mmask16>(0)
                         : static_cast<__mmask16>((1u << count) - 1);
}
// The first `count` lanes of `src`, zero past them.
inline Vec load_first(const float* src, int64_t count) {
  return _mm512_maskz_loadu_ps(first_lanes(count), src);
}
inline void store_first(float* dst, Vec v, int64_t count) {
  _mm512_mask_storeu_ps(dst, first_lanes(count), v);
}
// 16 floats → bf16 as cpu_vec_math.h's store16 rounds them, the first `count` of them.
inline void store_first(uint16_t* dst, Vec v, int64_t count) {
  auto* out = reinterpret_cast<c10::BFloat16*>(dst);
  if (count >= kLanes) {
    store16(out, v);
    return;
  }
  c10::BFloat16 row[kLanes];
  store16(row, v);
  for (int64_t i = 0; i < count; ++i) out[i] = row[i];
}

#else

using Vec = __m256;
constexpr int64_t kLanes = 8;
// 12 sums, two panel vectors and a broadcast: 15 of the 16 vector registers.
constexpr int64_t kTileRows = 6;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec broadcast(const float* x) { return _mm256_broadcast_ss(x); }
inline void load_panel_row(const float* w, Vec& lo, Vec& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + kLanes);
}
inline void load_panel_row(const uint16_t* w, Vec& lo, Vec& hi) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xffff0000u))));
}
inline __m256i first_lanes(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int clamped = static_cast<int>(std::clamp<int64_t>(count, 0, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), lane);
}
inline Vec load_first(const float* src, int64_t count) {
  return _mm256_maskload_ps(src, first_lanes(count));
}
inline void store_first(float* dst, Vec v, int64_t count) {
  _mm256_maskstore_ps(dst, first_lanes(count), v);
}
inline void store_first(uint16_t* dst, Vec v, int64_t count) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  // packus interleaves its inputs' 128-bit halves; the permute puts them in order.
  const __m128i narrow = _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08));
  if (count >= kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), narrow);
    return;
  }
  alignas(16) uint16_t row[kLanes];
  _mm_store_si128(reinterpret_cast<__m128i*>(row), narrow);
  for (int64_t i = 0; i < count; ++i) dst[i] = row[i];
}

#endif

constexpr int64_t kPanel = 2 * kLanes;  // columns per panel
constexpr int64_t kGroupTiles = 8;      // row tiles per work item

// The sums of M rows (M <= kTileRows) of x against one panel over k in [0, K), `Chains`
// interleaved partial sums per output vector, added in a fixed order at the end; while it
// runs, a tile of three rows or more prefetches `ahead_lines` cache lines from `ahead`,
// one a k. One and two rows read their panel faster than any prefetch can run ahead of
// them: their stream is the hardware prefetcher's, which they ran faster without ours.
// The loops over rows and chains are unrolled by pragma: left to itself, GCC keeps `acc`
// in memory and stores every sum back at each k.
template <int M, int Chains, typename W, typename Out>
void tile(const float* x, int64_t x_stride, const W* panel, int64_t k_total, const float* bias,
          Out* out, int64_t out_stride, int64_t valid, const char* ahead, int64_t ahead_lines) {
  Vec acc[Chains][M][2];
#pragma GCC unroll 16
  for (int c = 0; c < Chains; ++c)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[c][m][0] = acc[c][m][1] = zero();
  int64_t k = 0;
  for (; k + Chains <= k_total; k += Chains) {
#pragma GCC unroll 16
    for (int c = 0; c < Chains; ++c) {
      if (M > 2 && k + c < ahead_lines) _mm_prefetch(ahead + (k + c) * 64, _MM_HINT_T0);
      Vec w0, w1;
      load_panel_row(panel + (k + c) * kPanel, w0, w1);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const Vec xv = broadcast(x + m * x_stride + k + c);
        acc[c][m][0] = fmadd(xv, w0, acc[c][m][0]);
        acc[c][m][1] = fmadd(xv, w1, acc[c][m][1]);
      }
    }
  }
  for (; k < k_total; ++k) {
    Vec w0, w1;
    load_panel_row(panel + k * kPanel, w0, w1);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const Vec xv = broadcast(x + m * x_stride + k);
      acc[0][m][0] = fmadd(xv, w0, acc[0][m][0]);
      acc[0][m][1] = fmadd(xv, w1, acc[0][m][1]);
    }
  }
  const Vec bias_lo = bias != nullptr ? load_first(bias, valid) : zero();
  const Vec bias_hi = bias != nullptr ? load_first(bias + kLanes, valid - kLanes) : zero();
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    Vec lo = acc[0][m][0], hi = acc[0][m][1];
#pragma GCC unroll 16
    for (int c = 1; c < Chains; ++c) {
      lo = add(lo, acc[c][m][0]);
      hi = add(hi, acc[c][m][1]);
    }
    if (bias != nullptr) {
      lo = add(lo, bias_lo);
      hi = add(hi, bias_hi);
    }
    store_first(out + m * out_stride, lo, valid);
    if (valid > kLanes) store_first(out + m * out_stride + kLanes, hi, valid - kLanes);
  }
}

// Rows 1-2 split k over chains to hide the FMA's latency; three or more rows have enough
// independent sums in one chain.
template <typename W, typename Out>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, const float*, Out*, int64_t,
                        int64_t, const char*, int64_t);

template <typename W, typename Out, int M = kTileRows>
TileFn<W, Out> tile_for(int64_t rows) {
  if constexpr (M == 1) {
    return tile<1, 4, W, Out>;
  } else if constexpr (M == 2) {
    return rows == 2 ? tile<2, 2, W, Out> : tile_for<W, Out, 1>(rows);
  } else {
    return rows == M ? tile<M, 1, W, Out> : tile_for<W, Out, M - 1>(rows);
  }
}

// weight [N, K] → [ceil(N/kPanel), K, kPanel] in its own dtype, the columns past N zero;
// a bf16 panel's k holds its two vectors' columns interleaved (j, j + kLanes), as
// load_panel_row reads them.
inline at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  if (weight.scalar_type() != at::kBFloat16) {
    return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
  }
  // [panels, 2 halves, kLanes, K] → [panels, K, kLanes, 2 halves]
  return padded.view({panels, 2, kLanes, k}).permute({0, 3, 2, 1}).contiguous().view(
      {panels, k, kPanel});
}

// The checks of a linear's arguments: `packed` a pack_panels weight of `dtype` for x's
// `in_features`, `out_features` its rows, `bias` null or fp32 [out_features]; returns the
// bias's data (null where none).
inline const float* checked_bias(const at::Tensor& packed, at::ScalarType dtype,
                                 int64_t in_features, int64_t out_features,
                                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.scalar_type() == dtype,
              "packed must be ", dtype, " [N/", kPanel, ", K, ", kPanel, "] from pack_weight");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(in_features == packed.size(1), "x has ", in_features, " features, the weight ",
              packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed weight");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == out_features && bias->is_contiguous() &&
                  bias->scalar_type() == at::kFloat,
              "bias must be contiguous float32 [out_features]");
  return bias->data_ptr<float>();
}

// x [rows, K] fp32 (row stride x_stride) @ the packed weight [panels, K, kPanel] (+ bias,
// fp32 [out_features] or null) → out [rows, out_features], on torch's threads.
template <typename W, typename Out>
void linear_rows(const float* x, int64_t x_stride, int64_t rows, const W* packed, int64_t panels,
                 int64_t k_total, const float* bias, Out* out, int64_t out_features) {
  if (rows == 0) return;
  // Row groups of about equal size in whole tiles.
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  const int64_t group_rows = (tiles + groups - 1) / groups * kTileRows;
  const int64_t panel_elements = k_total * kPanel;
  const int64_t panel_lines = (panel_elements * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  const int64_t lines_per_tile = (panel_lines + tiles - 1) / tiles;
  at::parallel_for(0, panels * groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t panel = item / groups, group = item % groups;
      const int64_t col = panel * kPanel, valid = std::min(kPanel, out_features - col);
      const W* w = packed + panel * panel_elements;
      const char* next =
          panel + 1 < panels ? reinterpret_cast<const char*>(w + panel_elements) : nullptr;
      const float* b = bias != nullptr ? bias + col : nullptr;
      const int64_t stop = std::min(rows, (group + 1) * group_rows);
      for (int64_t r = group * group_rows; r < stop; r += kTileRows) {
        const int64_t m = std::min(kTileRows, stop - r);
        const int64_t first_line = std::min(panel_lines, r / kTileRows * lines_per_tile);
        const char* ahead = next != nullptr ? next + first_line * 64 : nullptr;
        const int64_t lines =
            ahead != nullptr ? std::min(lines_per_tile, panel_lines - first_line) : 0;
        tile_for<W, Out>(m)(x + r * x_stride, x_stride, w, k_total, b,
                            out + r * out_features + col, out_features, valid, ahead, lines);
      }
    }
  });
}

}  // namespace plugserve::fma

#endif
