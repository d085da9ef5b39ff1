// fp32 matmul in AVX2 + FMA register tiles: out = x @ W.T (+ bias), for any row count;
// torch.ops.plugserve_fp32.pack_weight / linear, loaded by cpu_fp32.py (its kernel avx2).
//
// On a CPU without AVX-512, oneDNN's fp32 matmul runs an encoder's or a prefill's small
// row counts well below the cores' FMA rate. Here the weight is packed once into 16-column
// panels, [N/16][K][16], so that one k of a panel is two 8-float vectors on one cache line,
// and a tile of up to 6 rows x 16 columns keeps its 12 sums in registers over the whole K:
// per k, two weight loads and six broadcasts feed twelve FMAs. Fewer rows keep more
// independent sums per row (k split over chains), so that one row (a decode step) is not
// bound by the FMA's latency but by reading the panel.
//
// Work items are (panel, group of rows): a thread keeps one panel's K x 64 bytes in its
// caches while the tiles of its rows run over it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kPanel = 16;      // columns per panel
constexpr int64_t kTileRows = 6;    // rows per register tile
constexpr int64_t kGroupTiles = 8;  // row tiles per work item

// Sums of M rows (M <= 6) against one panel over k in [0, K), `Chains` interleaved
// partial sums per output vector, added in a fixed order at the end.
// The loops over rows and chains are unrolled by pragma: left to itself, GCC keeps `acc` in
// memory and stores every sum back at each k.
// While it runs, the tile prefetches `ahead_lines` cache lines from `ahead` (its share of
// the next panel), one a k: the next panel streams in from memory under this one's FMAs
// instead of after them.
template <int M, int Chains>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t k_total,
          const float* bias, float* out, int64_t out_stride, int64_t valid, const char* ahead,
          int64_t ahead_lines) {
  __m256 acc[Chains][M][2];
  #pragma GCC unroll 16
  for (int c = 0; c < Chains; ++c)
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[c][m][0] = acc[c][m][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + Chains <= k_total; k += Chains) {
    #pragma GCC unroll 16
    for (int c = 0; c < Chains; ++c) {
      const float* w = panel + (k + c) * kPanel;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k + c);
        acc[c][m][0] = _mm256_fmadd_ps(xv, w0, acc[c][m][0]);
        acc[c][m][1] = _mm256_fmadd_ps(xv, w1, acc[c][m][1]);
      }
    }
  }
  for (; k < k_total; ++k) {
    const float* w = panel + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
      acc[0][m][0] = _mm256_fmadd_ps(xv, w0, acc[0][m][0]);
      acc[0][m][1] = _mm256_fmadd_ps(xv, w1, acc[0][m][1]);
    }
  }
  // Masked stores for a panel cut short by the width: no call in this loop, so the
  // compiler unrolls it and keeps the sums in registers through the k loop.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane);
  const __m256i mask_hi =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid) - 8), lane);
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    __m256 lo = acc[0][m][0], hi = acc[0][m][1];
    #pragma GCC unroll 16
    for (int c = 1; c < Chains; ++c) {
      lo = _mm256_add_ps(lo, acc[c][m][0]);
      hi = _mm256_add_ps(hi, acc[c][m][1]);
    }
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_maskload_ps(bias, mask_lo));
      hi = _mm256_add_ps(hi, _mm256_maskload_ps(bias + 8, mask_hi));
    }
    float* dst = out + m * out_stride;
    _mm256_maskstore_ps(dst, mask_lo, lo);
    _mm256_maskstore_ps(dst + 8, mask_hi, hi);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                        int64_t, int64_t, const char*, int64_t);

// Rows 1-2 split k over chains to hide the FMA's latency; three or more rows have enough
// independent sums in one chain.
TileFn tile_for(int64_t rows) {
  switch (rows) {
    case 1: return tile<1, 4>;
    case 2: return tile<2, 2>;
    case 3: return tile<3, 1>;
    case 4: return tile<4, 1>;
    case 5: return tile<5, 1>;
    default: return tile<6, 1>;
  }
}

// weight [N, K] fp32 → [ceil(N/16), K, 16], the columns past N zero.
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be float32 [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be float32 [rows, in_features] with a dense last dim");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.scalar_type() == at::kFloat,
              "packed must be float32 [N/16, K, 16] from pack_weight");
  const int64_t rows = x.size(0), k_total = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x.size(1) == k_total, "x has ", x.size(1), " features, the weight ", k_total);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed weight");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be contiguous float32 [out_features]");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Row groups of about equal size in whole tiles; the groups vary fastest among the items,
  // so a thread's contiguous share is whole panels, each read once for all its rows.
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  const int64_t group_rows = (tiles + groups - 1) / groups * kTileRows;
  // Each of a panel's tiles prefetches its share of the next panel's K lines.
  const int64_t lines_per_tile = (k_total + tiles - 1) / tiles;
  at::parallel_for(0, panels * groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t panel = item / groups, group = item % groups;
      const int64_t col = panel * kPanel, valid = std::min(kPanel, out_features - col);
      const float* w = wp + panel * k_total * kPanel;
      const char* next = panel + 1 < panels ? reinterpret_cast<const char*>(w + k_total * kPanel)
                                            : nullptr;
      const float* b = bias_data != nullptr ? bias_data + col : nullptr;
      const int64_t stop = std::min(rows, (group + 1) * group_rows);
      for (int64_t r = group * group_rows; r < stop; r += kTileRows) {
        const int64_t m = std::min(kTileRows, stop - r);
        const int64_t first_line = std::min(k_total, r / kTileRows * lines_per_tile);
        const char* ahead = next != nullptr ? next + first_line * 64 : nullptr;
        const int64_t lines = ahead != nullptr ? std::min(lines_per_tile, k_total - first_line) : 0;
        tile_for(m)(xp + r * x_stride, x_stride, w, k_total, b, op + r * out_features + col,
                    out_features, valid, ahead, lines);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(plugserve_fp32, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(plugserve_fp32, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("linear", &linear);
}

#endif
