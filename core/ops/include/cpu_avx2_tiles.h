// A matmul in AVX2 + FMA register tiles, for CPUs without AVX-512: out = x @ W.T (+ bias)
// for any row count, x in fp32, the weight in fp32 or bf16 (widened to fp32 in registers:
// products and sums in fp32), the output fp32 or bf16 (rounded to nearest even). Defined
// only where the compiler targets AVX2 and FMA (PLUGSERVE_HAS_AVX2_TILES).
//
// The weight is packed once (pack_panels) into 16-column panels, [N/16][K][16], zero past
// N, so that one k of a panel is two 8-float vectors (one cache line in fp32, half of one
// in bf16). A tile of up to 6 rows x 16 columns keeps its 12 sums in registers over the
// whole K: per k, the panel's two vectors and six broadcasts of x feed twelve FMAs. One
// and two rows split k over chains, so that a decode step is bound by reading the panel,
// not by the FMA's latency. Each tile of three rows or more prefetches its share of the
// next panel, which then streams in from memory under this one's FMAs.
//
// Work items are (panel, group of rows): a thread keeps one panel in its caches while the
// tiles of its rows run over it; the groups vary fastest, so a thread's share of the items
// is whole panels, each read once for all its rows.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define PLUGSERVE_HAS_AVX2_TILES 1
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace plugserve::avx2 {

constexpr int64_t kPanel = 16;      // columns per panel
constexpr int64_t kTileRows = 6;    // rows per register tile
constexpr int64_t kGroupTiles = 8;  // row tiles per work item

// One k of a panel as two 8-float vectors: fp32 as it lies, bf16 widened (its bits are
// an fp32's high half).
inline void load_panel_row(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
inline void load_panel_row(const uint16_t* w, __m256& lo, __m256& hi) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits)), 16));
  hi = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1)), 16));
}

// 8 floats → their bf16 bits in the low halves of 8 lanes, rounded to nearest even, a NaN
// kept a quiet NaN (cpu_bf16.h's store).
inline __m256i round_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
  return _mm256_srli_epi32(rounded, 16);
}

// A tile row's 16 sums into `dst`, its first `valid` columns.
inline void store_row(float* dst, __m256 lo, __m256 hi, int64_t valid) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live = _mm256_set1_epi32(static_cast<int>(valid));
  const __m256i live_hi = _mm256_sub_epi32(live, _mm256_set1_epi32(8));
  _mm256_maskstore_ps(dst, _mm256_cmpgt_epi32(live, lane), lo);
  _mm256_maskstore_ps(dst + 8, _mm256_cmpgt_epi32(live_hi, lane), hi);
}
inline void store_row(uint16_t* dst, __m256 lo, __m256 hi, int64_t valid) {
  // packus interleaves the two inputs' 128-bit halves; the permute puts them in order.
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(round_to_bf16(lo), round_to_bf16(hi)), 0xd8);
  if (valid == kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
    return;
  }
  alignas(32) uint16_t row[kPanel];
  _mm256_store_si256(reinterpret_cast<__m256i*>(row), packed);
  for (int64_t i = 0; i < valid; ++i) dst[i] = row[i];
}

// The sums of M rows (M <= 6) of x against one panel over k in [0, K), `Chains`
// interleaved partial sums per output vector, added in a fixed order at the end; while it
// runs, a tile of three rows or more prefetches `ahead_lines` cache lines from `ahead`,
// one a k. One and two rows read their panel faster than any prefetch can run ahead of
// them: their stream is the hardware prefetcher's, which they ran faster without ours.
// The loops over rows and chains are unrolled by pragma: left to itself, GCC keeps `acc`
// in memory and stores every sum back at each k.
template <int M, int Chains, typename W, typename Out>
void tile(const float* x, int64_t x_stride, const W* panel, int64_t k_total, const float* bias,
          Out* out, int64_t out_stride, int64_t valid, const char* ahead, int64_t ahead_lines) {
  __m256 acc[Chains][M][2];
#pragma GCC unroll 16
  for (int c = 0; c < Chains; ++c)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[c][m][0] = acc[c][m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + Chains <= k_total; k += Chains) {
#pragma GCC unroll 16
    for (int c = 0; c < Chains; ++c) {
      if (M > 2 && k + c < ahead_lines) _mm_prefetch(ahead + (k + c) * 64, _MM_HINT_T0);
      __m256 w0, w1;
      load_panel_row(panel + (k + c) * kPanel, w0, w1);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k + c);
        acc[c][m][0] = _mm256_fmadd_ps(xv, w0, acc[c][m][0]);
        acc[c][m][1] = _mm256_fmadd_ps(xv, w1, acc[c][m][1]);
      }
    }
  }
  for (; k < k_total; ++k) {
    __m256 w0, w1;
    load_panel_row(panel + k * kPanel, w0, w1);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
      acc[0][m][0] = _mm256_fmadd_ps(xv, w0, acc[0][m][0]);
      acc[0][m][1] = _mm256_fmadd_ps(xv, w1, acc[0][m][1]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live = _mm256_set1_epi32(static_cast<int>(valid));
  const __m256i bias_lo = _mm256_cmpgt_epi32(live, lane);
  const __m256i bias_hi = _mm256_cmpgt_epi32(_mm256_sub_epi32(live, _mm256_set1_epi32(8)), lane);
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    __m256 lo = acc[0][m][0], hi = acc[0][m][1];
#pragma GCC unroll 16
    for (int c = 1; c < Chains; ++c) {
      lo = _mm256_add_ps(lo, acc[c][m][0]);
      hi = _mm256_add_ps(hi, acc[c][m][1]);
    }
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_maskload_ps(bias, bias_lo));
      hi = _mm256_add_ps(hi, _mm256_maskload_ps(bias + 8, bias_hi));
    }
    store_row(out + m * out_stride, lo, hi, valid);
  }
}

// Rows 1-2 split k over chains to hide the FMA's latency; three or more rows have enough
// independent sums in one chain.
template <typename W, typename Out>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, const float*, Out*, int64_t,
                        int64_t, const char*, int64_t);

template <typename W, typename Out>
TileFn<W, Out> tile_for(int64_t rows) {
  switch (rows) {
    case 1: return tile<1, 4, W, Out>;
    case 2: return tile<2, 2, W, Out>;
    case 3: return tile<3, 1, W, Out>;
    case 4: return tile<4, 1, W, Out>;
    case 5: return tile<5, 1, W, Out>;
    default: return tile<6, 1, W, Out>;
  }
}

// weight [N, K] → [ceil(N/16), K, 16] in its own dtype, the columns past N zero.
inline at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// The checks of a linear's arguments: `packed` a pack_panels weight of `dtype` for x's
// `in_features`, `out_features` its rows, `bias` null or fp32 [out_features]; returns the
// bias's data (null where none).
inline const float* checked_bias(const at::Tensor& packed, at::ScalarType dtype,
                                 int64_t in_features, int64_t out_features,
                                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.scalar_type() == dtype,
              "packed must be ", dtype, " [N/16, K, 16] from pack_weight");
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

// x [rows, K] fp32 (row stride x_stride) @ the packed weight [panels, K, 16] (+ bias, fp32
// [out_features] or null) → out [rows, out_features], on torch's threads.
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

}  // namespace plugserve::avx2

#endif
