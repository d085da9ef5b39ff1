// int8 weights with int8 activations (W8A8) for AVX512-VNNI CPUs, and AMX-INT8 tiles where
// the CPU has them: y = x @ W.T (+ bias), every product an exact int8 one summed in int32.
//
// Weights: symmetric per output row, w ≈ q * w_scale[n], q in [-127, 127], packed as
// [N/16 blocks][K/4 quads][16 columns][4]: one 64-byte vector holds four consecutive k of
// 16 output columns, which is what VPDPBUSD takes beside four broadcast activation bytes,
// and 16 consecutive quads of a block are one AMX B tile (TDPBUSD), read in place. K is
// padded to a multiple of 64 with zero weights (a tile's 64 bytes of k), N to 16.
//
// Activations: quantized per row (token) on the fly, asymmetric to uint8, as both
// instructions take them: x ≈ (xq - zero) * x_scale with x_scale = (max - min) / 255 over
// the row, the range widened to hold 0 so that zero is a code. A row's outliers, values
// more than kOutlierRms times the row's root mean square from zero, are left out of that
// range (their code is the zero point) and kept exactly: a transformer's activations carry a
// few channels far larger than the rest, and one of them would otherwise set the step of
// every other value of its row. Fewer than K / 36 values of a row can pass that bound (their
// squares alone would exceed the row's sum), so each row has room for Kp / 32 of them. Then
//   y[m, n] = x_scale[m] * w_scale[n] * (sum_k xq[m, k] q[n, k] - zero[m] * w_sum[n])
//           + w_scale[n] * sum_o x[m, k_o] q[n, k_o]          (the row's outliers k_o)
// where w_sum[n] = sum_k q[n, k] is computed once at load: the zero point's compensation
// term. The int32 sums are exact (K * 255 * 127 stays far below 2^31 for any K below 65536).
//
// One row (a batch-1 decode step) either streams each 16-column block once with four chains
// over alternating quads, or runs the register tiles below on one row (three blocks
// interleaved), whichever measures faster here; either splits its items over the process's
// row pool (row_pool.h) where that is on, else over torch's threads. The weights are read
// once, half the bytes of bf16. Up to eight rows
// share each weight vector in registers (tile); many rows run AMX tiles where built
// (kernel 1), each 16x16 int32 block of sums over K in 64-byte steps.
//
// More rows can also run torch._int_mm (kernel 2); which kernel runs a row count is the
// model's measured plan (w8a8_plan.py), held with each weight (W8A8Weight), so that a fused
// CPU decoder calls a layer's matmul as a plain C++ call (layer_linear.h) as Python does.
//
// Registered as torch.ops.plugserve_w8a8.* and torch.classes.plugserve_w8a8.W8A8Weight;
// built and loaded by int8_w8a8.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "layer_linear.h"
#include "row_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PLUGSERVE_HAS_W8A8 1

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PLUGSERVE_HAS_AMX_INT8 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kQuadBytes = 64;  // one quad of k for one 16-column block
// A value this many times its row's root mean square from zero is an outlier (top of file).
constexpr float kOutlierRms = 6.0f;
constexpr int64_t kRowTile = 8;  // rows sharing a weight vector in registers
constexpr int64_t kBlockTile = 3;  // 16-column blocks per register tile
constexpr int kKernelVnni = 0, kKernelAmx = 1, kKernelIntMm = 2, kKernelVnniTiled = 3;

struct Args {
  const uint8_t* xq;  // [M, Kp]
  int64_t x_stride;  // Kp
  const int8_t* w;  // packed
  int64_t block_stride;  // bytes between blocks: quads * 64
  int64_t quads;
  const float* x_scale;  // [M]
  const int32_t* x_zero;  // [M]
  const float* w_scale;  // [N]
  const int32_t* w_sum;  // [N]
  const float* bias;  // [N] or nullptr
  int64_t n;  // out_features
  const int32_t* outliers;  // [M]: how many of the row's values are kept exactly
  const int32_t* outlier_k;  // [M, room]: their places, ascending
  const float* outlier_x;  // [M, room]: their values
  int64_t room;  // Kp / 32
};

inline __mmask16 mask_for(int64_t valid) {
  return valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
}

// 16 fp32 lanes stored as bf16 rounded to nearest even (no AVX512_BF16 needed), or as fp32.
inline void store16(float* out, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(out, mask, v); }
inline void store16(c10::BFloat16* out, __mmask16 mask, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(rounded));
}

// Weight column k of the 16-column block at `block`, as floats: byte k % 4 of each column's
// quad k / 4.
inline __m512 weight_column(const int8_t* block, int32_t k) {
  const __m512i quad = _mm512_loadu_si512(block + (k / 4) * kQuadBytes);
  const __m512i to_top = _mm512_set1_epi32(24 - 8 * (k % 4));
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(quad, to_top), 24));
}

// Row m's outliers times their weight columns of the 16-column block at `col`, summed in
// the outliers' order (the block's quads are in cache: the kernel has just read them). Out
// of finish16, which a row without outliers then passes through in a few instructions.
__attribute__((noinline)) __m512 outlier_products(int64_t m, int64_t col, const Args& a) {
  const int8_t* block = a.w + (col / 16) * a.block_stride;
  __m512 products = _mm512_setzero_ps();
  for (int32_t o = 0; o < a.outliers[m]; ++o) {
    const int64_t at = m * a.room + o;
    products = _mm512_fmadd_ps(_mm512_set1_ps(a.outlier_x[at]),
                               weight_column(block, a.outlier_k[at]), products);
  }
  return products;
}

// Row m's int32 sums of columns [col, col + 16) → dequantized, its outliers' products (given
// where `products_given`, else computed here) and the bias added, into dst[0..16).
// Not inlined: under -ffast-math the compiler may regroup the products differently in each
// caller, and every kernel must give the same bits.
template <typename Out>
__attribute__((noinline)) void finish16(__m512i acc, int64_t m, int64_t col, const Args& a,
                                        Out* dst, __m512 products = _mm512_setzero_ps(),
                                        bool products_given = false) {
  const __mmask16 mask = mask_for(a.n - col);
  const __m512i w_sum = _mm512_maskz_loadu_epi32(mask, a.w_sum + col);
  const __m512i exact =
      _mm512_sub_epi32(acc, _mm512_mullo_epi32(_mm512_set1_epi32(a.x_zero[m]), w_sum));
  const __m512 w_scale = _mm512_maskz_loadu_ps(mask, a.w_scale + col);
  __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(exact),
                           _mm512_mul_ps(_mm512_set1_ps(a.x_scale[m]), w_scale));
  if (a.outliers[m] > 0)
    y = _mm512_fmadd_ps(products_given ? products : outlier_products(m, col, a), w_scale, y);
  if (a.bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, a.bias + col));
  store16(dst, mask, y);
}

// The outliers of some rows side by side (tile, int_mm_rows): every place one of the rows
// has an outlier at, ascending, and each row's value there, zero where it has none. A weight
// column is then converted once for all the rows, and a row's products, summed over every
// place in order, equal outlier_products': each zero adds nothing.
struct RowsOutliers {
  std::vector<int32_t> places;
  std::vector<float> values;  // [places][width]

  // Rows [r0, r0 + count), side by side in `width` (>= count) columns; false where none of
  // them has an outlier.
  bool gather(const Args& a, int64_t r0, int64_t count, int64_t width) {
    places.clear();
    for (int64_t i = 0; i < count; ++i)
      places.insert(places.end(), a.outlier_k + (r0 + i) * a.room,
                    a.outlier_k + (r0 + i) * a.room + a.outliers[r0 + i]);
    if (places.empty()) return false;
    std::sort(places.begin(), places.end());
    places.erase(std::unique(places.begin(), places.end()), places.end());
    values.assign(places.size() * width, 0.0f);
    for (int64_t i = 0; i < count; ++i)
      for (int32_t o = 0; o < a.outliers[r0 + i]; ++o) {
        const int64_t at = (r0 + i) * a.room + o;
        const auto p = std::lower_bound(places.begin(), places.end(), a.outlier_k[at]);
        values[(p - places.begin()) * width + i] = a.outlier_x[at];
      }
    return true;
  }

  // The rows' products with the 16-column block at `block` (Rows = the width gathered).
  template <int Rows>
  void products(const int8_t* block, __m512 (&out)[Rows]) const {
    for (auto& v : out) v = _mm512_setzero_ps();
    for (size_t p = 0; p < places.size(); ++p) {
      const __m512 w = weight_column(block, places[p]);
      for (int i = 0; i < Rows; ++i)
        out[i] = _mm512_fmadd_ps(_mm512_set1_ps(values[p * Rows + i]), w, out[i]);
    }
  }
};

inline __m512i broadcast_quad(const uint8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

// One row against block b: its 16 outputs into out (already at the block's place). Four
// chains over alternating quads (one would wait on the previous VPDPBUSD); the stream is
// prefetched non-temporally, each weight line being read once a step.
template <typename Out>
void row_item(const void* args, int64_t b, void* out) {
  const Args& a = *static_cast<const Args*>(args);
  constexpr int64_t kPrefetchBytes = 2048;
  const int8_t* w = a.w + b * a.block_stride;
  __m512i acc[4];
  for (auto& c : acc) c = _mm512_setzero_si512();
  int64_t q = 0;
  for (; q + 4 <= a.quads; q += 4) {
    for (int c = 0; c < 4; ++c) {
      const int8_t* p = w + (q + c) * kQuadBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_NTA);
      acc[c] = _mm512_dpbusd_epi32(acc[c], broadcast_quad(a.xq + 4 * (q + c)),
                                   _mm512_loadu_si512(p));
    }
  }
  for (; q < a.quads; ++q)
    acc[0] = _mm512_dpbusd_epi32(acc[0], broadcast_quad(a.xq + 4 * q),
                                 _mm512_loadu_si512(w + q * kQuadBytes));
  const __m512i sum =
      _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]));
  finish16(sum, 0, b * 16, a, static_cast<Out*>(out));
}

// Rows [r0, r0 + M) against blocks [b0, b0 + NB): every weight vector loaded once feeds
// the M rows' VPDPBUSD, M x NB accumulators in registers. Output column c of row m goes to
// out[m * n + c - first_col].
template <int M, int NB, typename Out>
void tile(const Args& a, int64_t r0, int64_t b0, Out* out, int64_t first_col,
          const RowsOutliers* outliers) {
  __m512i acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_si512();
  const uint8_t* x = a.xq + r0 * a.x_stride;
  for (int64_t q = 0; q < a.quads; ++q) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      const int8_t* p = a.w + (b0 + b) * a.block_stride + q * kQuadBytes;
      wv[b] = _mm512_loadu_si512(p);
      _mm_prefetch(reinterpret_cast<const char*>(p) + 16 * kQuadBytes, _MM_HINT_T0);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i xb = broadcast_quad(x + m * a.x_stride + 4 * q);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbusd_epi32(acc[m][b], xb, wv[b]);
    }
  }
  if (outliers != nullptr) {
    __m512 products[NB][kRowTile];
    for (int b = 0; b < NB; ++b)
      outliers->products<kRowTile>(a.w + (b0 + b) * a.block_stride, products[b]);
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) {
        const int64_t col = (b0 + b) * 16;
        finish16(acc[m][b], r0 + m, col, a, out + (r0 + m) * a.n + col - first_col,
                 products[b][m], true);
      }
    return;
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = (b0 + b) * 16;
      finish16(acc[m][b], r0 + m, col, a, out + (r0 + m) * a.n + col - first_col);
    }
}

template <typename Out>
using TileFn = void (*)(const Args&, int64_t, int64_t, Out*, int64_t, const RowsOutliers*);

template <int M, typename Out>
TileFn<Out> pick_blocks(int64_t nb) {
  return nb == 1 ? tile<M, 1, Out> : nb == 2 ? tile<M, 2, Out> : tile<M, 3, Out>;
}

template <typename Out>
TileFn<Out> tile_for(int64_t rows, int64_t nb) {
  switch (rows) {
    case 1: return pick_blocks<1, Out>(nb);
    case 2: return pick_blocks<2, Out>(nb);
    case 3: return pick_blocks<3, Out>(nb);
    case 4: return pick_blocks<4, Out>(nb);
    case 5: return pick_blocks<5, Out>(nb);
    case 6: return pick_blocks<6, Out>(nb);
    case 7: return pick_blocks<7, Out>(nb);
    default: return pick_blocks<8, Out>(nb);
  }
}

// One row through the register tiles as a RowPool job: item t is tile t's outputs.
template <typename Out>
void tile_item(const void* args, int64_t t, void* out) {
  const Args& a = *static_cast<const Args*>(args);
  const int64_t blocks = (a.n + 15) / 16, b0 = t * kBlockTile;
  tile_for<Out>(1, std::min(kBlockTile, blocks - b0))(a, 0, b0, static_cast<Out*>(out), b0 * 16,
                                                    nullptr);
}

// `stream`: one row as a stream of blocks (row_item), else through the register tiles as
// more rows run (which CPU reads which faster is measured: w8a8_plan.py).
template <typename Out>
void vnni_rows(const Args& a, int64_t rows, int64_t blocks, Out* out,
               const std::array<at::Tensor, 4>& inputs, bool stream) {
  plugserve::RowPool* pool =
      rows == 1 && at::get_num_threads() > 1 ? plugserve::lookup_row_pool() : nullptr;
  if (rows == 1 && !stream && pool != nullptr && pool->enabled()) {
    const int64_t tiles = (blocks + kBlockTile - 1) / kBlockTile;
    const int64_t item = kBlockTile * 16;
    pool->run(plugserve::RowPool::make_job(&tile_item<Out>, a, tiles, out, item * sizeof(Out),
                                           (a.n - (tiles - 1) * item) * sizeof(Out), inputs));
    return;
  }
  if (rows == 1 && stream) {
    if (pool != nullptr && pool->enabled()) {
      const int64_t last = a.n - (blocks - 1) * 16;
      pool->run(plugserve::RowPool::make_job(&row_item<Out>, a, blocks, out, 16 * sizeof(Out),
                                             last * sizeof(Out), inputs));
      return;
    }
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) row_item<Out>(&a, b, out + b * 16);
    });
    return;
  }
  // Each row chunk's outliers side by side, gathered once for every tile.
  std::vector<RowsOutliers> chunk_outliers((rows + kRowTile - 1) / kRowTile);
  std::vector<const RowsOutliers*> outliers(chunk_outliers.size(), nullptr);
  for (size_t c = 0; c < chunk_outliers.size(); ++c) {
    const int64_t r = static_cast<int64_t>(c) * kRowTile;
    if (chunk_outliers[c].gather(a, r, std::min(kRowTile, rows - r), kRowTile))
      outliers[c] = &chunk_outliers[c];
  }
  // Tiles of kBlockTile blocks, each running every row chunk while its weights are in cache.
  const int64_t tiles = (blocks + kBlockTile - 1) / kBlockTile;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t b0 = t * kBlockTile, nb = std::min(kBlockTile, blocks - b0);
      for (int64_t r = 0; r < rows; r += kRowTile)
        tile_for<Out>(std::min(kRowTile, rows - r), nb)(a, r, b0, out, 0,
                                                         outliers[r / kRowTile]);
    }
  });
}

#ifdef PLUGSERVE_HAS_AMX_INT8

// Linux's arch_prctl request for a feature's state, and the AMX tile data feature.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_usable() {
  static const bool usable = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tiles tmm0-3 (row tile r, block c at 2r + c: m rows of 16 int32), A tiles tmm4-5 (m
// rows of 64 uint8), B tiles tmm6-7 (16 quads of 16 columns). An unused tile has 0 rows
// and 0 bytes a row: anything else faults in ldtilecfg.
void configure_tiles(int m0, int m1) {
  TileConfig config;
  for (int r = 0; r < 2; ++r) {
    const int m = r == 0 ? m0 : m1;
    const uint16_t bytes = m > 0 ? 64 : 0;
    for (int c = 0; c < 2; ++c) {
      config.rows[2 * r + c] = static_cast<uint8_t>(m);
      config.colsb[2 * r + c] = bytes;
    }
    config.rows[4 + r] = static_cast<uint8_t>(m);
    config.colsb[4 + r] = bytes;
  }
  for (int c = 0; c < 2; ++c) {
    config.rows[6 + c] = 16;
    config.colsb[6 + c] = 64;
  }
  // GCC drops the stores above as dead without this: it does not see that ldtilecfg
  // reads the whole 64 bytes.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Rows [r0, r0 + m0 + m1) against blocks b0 and b0 + 1 (nb of them).
template <typename Out>
void amx_item(const Args& a, int64_t r0, int64_t b0, int nb, int m0, int m1, Out* out) {
  _tile_zero(0);
  if (nb > 1) _tile_zero(1);
  if (m1 > 0) _tile_zero(2);
  if (m1 > 0 && nb > 1) _tile_zero(3);
  const int8_t* w0 = a.w + b0 * a.block_stride;
  const int8_t* w1 = w0 + a.block_stride;
  const uint8_t* x = a.xq + r0 * a.x_stride;
  for (int64_t q = 0; q < a.quads; q += 16) {
    _tile_loadd(4, x + 4 * q, a.x_stride);
    _tile_loadd(6, w0 + q * kQuadBytes, 64);
    if (nb > 1) _tile_loadd(7, w1 + q * kQuadBytes, 64);
    _tile_dpbusd(0, 4, 6);
    if (nb > 1) _tile_dpbusd(1, 4, 7);
    if (m1 > 0) {
      _tile_loadd(5, x + 16 * a.x_stride + 4 * q, a.x_stride);
      _tile_dpbusd(2, 5, 6);
      if (nb > 1) _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t sums[16][16];
  for (int r = 0; r < (m1 > 0 ? 2 : 1); ++r) {
    const int m = r == 0 ? m0 : m1;
    for (int c = 0; c < nb; ++c) {
      // The tile index must be a constant: one store per (r, c).
      if (r == 0 && c == 0) _tile_stored(0, sums, 64);
      if (r == 0 && c == 1) _tile_stored(1, sums, 64);
      if (r == 1 && c == 0) _tile_stored(2, sums, 64);
      if (r == 1 && c == 1) _tile_stored(3, sums, 64);
      const int64_t col = (b0 + c) * 16;
      for (int i = 0; i < m; ++i) {
        const int64_t row = r0 + 16 * r + i;
        finish16(_mm512_load_si512(sums[i]), row, col, a, out + row * a.n + col);
      }
    }
  }
}

template <typename Out>
void amx_rows(const Args& a, int64_t rows, int64_t blocks, Out* out) {
  const int64_t items = (blocks + 1) / 2;
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    int configured = -1;  // m0 * 64 + m1 of the tiles this thread configured
    // Item outside, rows inside: an item's two blocks stay in cache while every row chunk
    // reads them.
    for (int64_t item = first; item < last; ++item) {
      const int64_t b0 = 2 * item;
      const int nb = b0 + 1 < blocks ? 2 : 1;
      for (int64_t r = 0; r < rows; r += 32) {
        const int m0 = static_cast<int>(std::min<int64_t>(16, rows - r));
        const int m1 = static_cast<int>(std::clamp<int64_t>(rows - r - 16, 0, 16));
        if (configured != m0 * 64 + m1) {
          configure_tiles(m0, m1);
          configured = m0 * 64 + m1;
        }
        amx_item<Out>(a, r, b0, nb, m0, m1, out);
      }
    }
    _tile_release();
  });
}

#endif

bool amx_available() {
#ifdef PLUGSERVE_HAS_AMX_INT8
  return amx_usable();
#else
  return false;
#endif
}

template <typename In>
inline __m512 load16(const In* p, __mmask16 mask) {
  if constexpr (std::is_same_v<In, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
}

// Row x [K] → xq [Kp] (zeros past K), its scale and zero point, and its outliers, kept
// exactly (see the top of the file).
template <typename In>
void quantize_row(const In* x, int64_t K, int64_t Kp, int64_t room, uint8_t* xq, float* scale,
                  int32_t* zero, int32_t* outliers, int32_t* outlier_k, float* outlier_x) {
  __m512 squares = _mm512_setzero_ps();
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();  // the range holds 0
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = mask_for(K - k);
    const __m512 v = load16(x + k, mask);
    squares = _mm512_fmadd_ps(v, v, squares);
    lo = _mm512_mask_min_ps(lo, mask, lo, v);
    hi = _mm512_mask_max_ps(hi, mask, hi, v);
  }
  const float bound =
      kOutlierRms * std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(K));
  int32_t count = 0;
  if (std::max(-_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi)) > bound) {
    // The outliers, and the range of the rest.
    const __m512 bound_v = _mm512_set1_ps(bound);
    const __m512i lanes =
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    lo = hi = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = mask_for(K - k);
      const __m512 v = load16(x + k, mask);
      __mmask16 far = _mm512_mask_cmp_ps_mask(mask, _mm512_abs_ps(v), bound_v, _CMP_GT_OQ);
      const int far_count = __builtin_popcount(static_cast<unsigned>(far));
      if (count + far_count > room) {
        far = 0;  // past the bound's room only by rounding: these stay in the range
      } else if (far != 0) {
        _mm512_mask_compressstoreu_epi32(outlier_k + count, far,
                                         _mm512_add_epi32(lanes, _mm512_set1_epi32(k)));
        _mm512_mask_compressstoreu_ps(outlier_x + count, far, v);
        count += far_count;
      }
      const __mmask16 near = mask & static_cast<__mmask16>(~far);
      lo = _mm512_mask_min_ps(lo, near, lo, v);
      hi = _mm512_mask_max_ps(hi, near, hi, v);
    }
  }
  const float mn = _mm512_reduce_min_ps(lo), mx = _mm512_reduce_max_ps(hi);
  const float s = mx > mn ? (mx - mn) / 255.0f : 1.0f;
  const int32_t z = std::clamp<int32_t>(static_cast<int32_t>(std::nearbyint(-mn / s)), 0, 255);
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512i zv = _mm512_set1_epi32(z), top = _mm512_set1_epi32(255);
  for (int64_t k = 0; k < Kp; k += 16) {
    const __mmask16 mask = k < K ? mask_for(K - k) : __mmask16(0);
    const __m512 v = load16(x + k, mask);
    __m512i code = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zv);
    code = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_setzero_si512()), top);
    code = _mm512_maskz_mov_epi32(mask, code);  // padding: 0
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(code));
  }
  for (int32_t o = 0; o < count; ++o) xq[outlier_k[o]] = static_cast<uint8_t>(z);  // no share
  *scale = s;
  *zero = z;
  *outliers = count;
}

// A matmul's quantized rows, in one buffer: a row-pool job holds them alive through it (a
// helper that comes back late still reads them).
struct QuantizedRows {
  at::Tensor buffer;
  int64_t rows, padded_k, room;
  uint8_t* xq;  // [rows, padded_k]
  float* scale;  // [rows]
  int32_t* zero;  // [rows]
  int32_t* outliers;  // [rows]
  int32_t* outlier_k;  // [rows, room]
  float* outlier_x;  // [rows, room]

  // A view of the buffer as `count` elements of `dtype` from `start`, one of its parts.
  at::Tensor part(const void* start, int64_t count, at::ScalarType dtype) const {
    const int64_t offset = static_cast<const uint8_t*>(start) - buffer.data_ptr<uint8_t>();
    return buffer.narrow(0, offset, count * static_cast<int64_t>(c10::elementSize(dtype)))
        .view(dtype);
  }
};

inline int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// x [M, K] bf16 or fp32 → its rows quantized (see quantize_row).
QuantizedRows quantize_rows(const at::Tensor& x, int64_t padded_k) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, K] with a dense last dim");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(padded_k >= K && padded_k % 64 == 0, "padded_k must be >= K and a multiple of 64");
  const int64_t room = padded_k / 32;
  const int64_t codes = aligned64(M * padded_k), per_row = aligned64(4 * M);
  const int64_t per_outlier = aligned64(4 * M * room);
  QuantizedRows q{at::empty({codes + 3 * per_row + 2 * per_outlier}, x.options().dtype(at::kByte)),
                  M, padded_k, room};
  uint8_t* base = q.buffer.data_ptr<uint8_t>();
  q.xq = base;
  q.scale = reinterpret_cast<float*>(base + codes);
  q.zero = reinterpret_cast<int32_t*>(base + codes + per_row);
  q.outliers = reinterpret_cast<int32_t*>(base + codes + 2 * per_row);
  q.outlier_k = reinterpret_cast<int32_t*>(base + codes + 3 * per_row);
  q.outlier_x = reinterpret_cast<float*>(base + codes + 3 * per_row + per_outlier);
  const int64_t stride = x.stride(0);
  const auto rows = [&](auto* xp, int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m)
      quantize_row(xp + m * stride, K, padded_k, room, q.xq + m * padded_k, q.scale + m,
                   q.zero + m, q.outliers + m, q.outlier_k + m * room, q.outlier_x + m * room);
  };
  // One row is a decode step's: too little work to wake the other threads for.
  const int64_t grain = M == 1 ? 1 : std::max<int64_t>(1, 4096 / K);
  at::parallel_for(0, M, grain, [&](int64_t first, int64_t last) {
    if (x.scalar_type() == at::kFloat) {
      rows(x.data_ptr<float>(), first, last);
    } else {
      rows(x.data_ptr<c10::BFloat16>(), first, last);
    }
  });
  return q;
}

// For tests: (codes uint8 [M, padded_k], scale fp32 [M], zero int32 [M], outlier count int32
// [M], their places int32 [M, padded_k / 32] and values fp32 [M, padded_k / 32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
quantize_per_token(const at::Tensor& x, int64_t padded_k) {
  const QuantizedRows q = quantize_rows(x, padded_k);
  const int64_t M = q.rows;
  return {q.part(q.xq, M * padded_k, at::kByte).view({M, padded_k}),
          q.part(q.scale, M, at::kFloat),
          q.part(q.zero, M, at::kInt),
          q.part(q.outliers, M, at::kInt),
          q.part(q.outlier_k, M * q.room, at::kInt).view({M, q.room}),
          q.part(q.outlier_x, M * q.room, at::kFloat).view({M, q.room})};
}

// The quantized rows through torch._int_mm over the plain quantized weight [N, K]: the
// codes shifted to int8 (xq - 128), the shift given back through the weight row's sum,
// sum(xq * q) = sum((xq - 128) * q) + 128 * w_sum, then finish16 as the other kernels, so
// that every kernel gives the same bits.
//
// The outliers' products 16 rows at a time (RowsOutliers).
template <typename Out>
void int_mm_rows(const Args& a, const QuantizedRows& q, const at::Tensor& plain, int64_t rows,
                 Out* out) {
  constexpr int64_t kChunk = 16;
  const int64_t K = plain.size(1);
  const at::Tensor xq = q.part(q.xq, q.rows * q.padded_k, at::kByte).view({q.rows, q.padded_k});
  const at::Tensor codes = (xq.narrow(1, 0, K).to(at::kShort) - 128).to(at::kChar);
  const at::Tensor sums = at::_int_mm(codes, plain.t()).contiguous();
  const int32_t* s = sums.data_ptr<int32_t>();
  const __m512i shift = _mm512_set1_epi32(128);
  const int64_t blocks = (a.n + 15) / 16;
  at::parallel_for(0, (rows + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
    RowsOutliers outliers;
    std::vector<float> products;  // [kChunk][N], once some chunk has outliers
    for (int64_t chunk = first; chunk < last; ++chunk) {
      const int64_t r0 = chunk * kChunk, n_rows = std::min(rows - r0, kChunk);
      const bool any = outliers.gather(a, r0, n_rows, kChunk);
      if (any) {
        products.resize(static_cast<size_t>(kChunk * 16 * blocks));
        for (int64_t b = 0; b < blocks; ++b) {
          __m512 sum[kChunk];
          outliers.products<kChunk>(a.w + b * a.block_stride, sum);
          for (int64_t i = 0; i < kChunk; ++i)
            _mm512_storeu_ps(products.data() + (i * blocks + b) * 16, sum[i]);
        }
      }
      // Row by row, each row's sums read front to back.
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t m = r0 + i;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t col = 16 * b;
          const __mmask16 mask = mask_for(a.n - col);
          const __m512i acc = _mm512_add_epi32(
              _mm512_maskz_loadu_epi32(mask, s + m * a.n + col),
              _mm512_mullo_epi32(shift, _mm512_maskz_loadu_epi32(mask, a.w_sum + col)));
          finish16(acc, m, col, a, out + m * a.n + col,
                   any ? _mm512_loadu_ps(products.data() + (i * blocks + b) * 16)
                       : _mm512_setzero_ps(),
                   true);
        }
      }
    }
  });
}

// A model's quantized linear: the packed weight, the plain one where the plan runs
// torch._int_mm, the scales and row sums, and per row bucket the kernel that runs it.
struct W8A8Weight : torch::CustomClassHolder {
  W8A8Weight(at::Tensor packed, c10::optional<at::Tensor> plain, at::Tensor w_scale,
             at::Tensor w_sum, c10::optional<at::Tensor> bias, int64_t out_features,
             std::vector<int64_t> kernels, std::vector<int64_t> bucket_last)
      : packed(std::move(packed)),
        plain(std::move(plain)),
        w_scale(std::move(w_scale)),
        w_sum(std::move(w_sum)),
        bias(std::move(bias)),
        out_features(out_features),
        kernels(std::move(kernels)),
        bucket_last(std::move(bucket_last)) {
    const int64_t blocks = this->packed.size(0), quads = this->packed.size(1);
    TORCH_CHECK(this->packed.dim() == 4 && this->packed.is_contiguous() &&
                    this->packed.size(2) == 16 && this->packed.size(3) == 4 &&
                    this->packed.scalar_type() == at::kChar && quads % 16 == 0,
                "packed must be int8 [N/16, Kp/4, 16, 4], Kp a multiple of 64 (pack_weight)");
    TORCH_CHECK(out_features > (blocks - 1) * 16 && out_features <= blocks * 16,
                "out_features does not match the packed weight");
    TORCH_CHECK(this->w_scale.scalar_type() == at::kFloat && this->w_scale.is_contiguous() &&
                    this->w_scale.numel() == out_features &&
                    this->w_sum.scalar_type() == at::kInt && this->w_sum.is_contiguous() &&
                    this->w_sum.numel() == out_features,
                "w_scale (float32) and w_sum (int32) need one entry an output");
    if (this->bias.has_value())
      TORCH_CHECK(this->bias->scalar_type() == at::kFloat && this->bias->is_contiguous() &&
                      this->bias->numel() == out_features,
                  "bias must be contiguous float32 [out_features]");
    if (this->plain.has_value())
      TORCH_CHECK(this->plain->scalar_type() == at::kChar && this->plain->dim() == 2 &&
                      this->plain->size(0) == out_features && this->plain->size(1) <= 4 * quads,
                  "plain must be the int8 [out_features, K] weight");
    TORCH_CHECK(this->bucket_last.size() + 1 == this->kernels.size(),
                "one kernel a row bucket, the last bucket unbounded");
    for (const int64_t kernel : this->kernels) check_kernel(kernel);
  }

  void check_kernel(int64_t kernel) const {
    TORCH_CHECK(kernel == kKernelVnni || kernel == kKernelVnniTiled ||
                    (kernel == kKernelAmx && amx_available()) ||
                    (kernel == kKernelIntMm && plain.has_value()),
                "kernel must be 0 (VNNI), 3 (VNNI, one row as tiles), 1 (AMX, where AMX-INT8 "
                "tiles run) or 2 (torch._int_mm, where the plain weight is kept)");
  }

  int64_t kernel_for(int64_t rows) const {
    for (size_t b = 0; b < bucket_last.size(); ++b)
      if (rows <= bucket_last[b]) return kernels[b];
    return kernels.back();
  }

  // x [M, K] bf16 or fp32 → x @ W.T (+ bias) [M, out_features] by `kernel`, or, with -1,
  // the plan's kernel for M rows.
  at::Tensor apply(const at::Tensor& x, at::ScalarType out_dtype, int64_t kernel) const {
    TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
    TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
                "out_dtype must be float32 or bfloat16");
    const int64_t M = x.size(0), blocks = packed.size(0), quads = packed.size(1);
    if (kernel < 0) {
      kernel = kernel_for(M);
    } else {
      check_kernel(kernel);
    }
    const QuantizedRows q = quantize_rows(x, 4 * quads);
    at::Tensor out = at::empty({M, out_features}, x.options().dtype(out_dtype));
    if (M == 0) return out;
    const Args a{q.xq,
                 q.padded_k,
                 packed.data_ptr<int8_t>(),
                 quads * kQuadBytes,
                 quads,
                 q.scale,
                 q.zero,
                 w_scale.data_ptr<float>(),
                 w_sum.data_ptr<int32_t>(),
                 bias.has_value() ? bias->data_ptr<float>() : nullptr,
                 out_features,
                 q.outliers,
                 q.outlier_k,
                 q.outlier_x,
                 q.room};
    const std::array<at::Tensor, 4> inputs{q.buffer, packed, w_scale, w_sum};
    const auto run = [&](auto* op) {
      if (kernel == kKernelIntMm) {
        int_mm_rows(a, q, *plain, M, op);
        return;
      }
#ifdef PLUGSERVE_HAS_AMX_INT8
      if (kernel == kKernelAmx) {
        amx_rows(a, M, blocks, op);
        return;
      }
#endif
      vnni_rows(a, M, blocks, op, inputs, kernel != kKernelVnniTiled);
    };
    if (out_dtype == at::kFloat) {
      run(out.data_ptr<float>());
    } else {
      run(out.data_ptr<c10::BFloat16>());
    }
    return out;
  }

  int64_t address() { return reinterpret_cast<int64_t>(this); }

  at::Tensor packed;
  c10::optional<at::Tensor> plain;
  at::Tensor w_scale, w_sum;
  c10::optional<at::Tensor> bias;
  int64_t out_features;
  std::vector<int64_t> kernels, bucket_last;
};

at::Tensor w8a8_apply(const c10::intrusive_ptr<W8A8Weight>& weight, const at::Tensor& x,
                      at::ScalarType out_dtype, int64_t kernel) {
  return weight->apply(x, out_dtype, kernel);
}

// layer_linear.h's call: the context is a W8A8Weight, the output x's dtype.
at::Tensor linear_call(const void* context, const at::Tensor& x) {
  return static_cast<const W8A8Weight*>(context)->apply(x, x.scalar_type(), -1);
}

int64_t linear_call_address() {
  const plugserve::LinearCallFn fn = &linear_call;
  return reinterpret_cast<int64_t>(fn);
}

}  // namespace

TORCH_LIBRARY(plugserve_w8a8, m) {
  m.class_<W8A8Weight>("W8A8Weight")
      .def(torch::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor,
                       c10::optional<at::Tensor>, int64_t, std::vector<int64_t>,
                       std::vector<int64_t>>())
      .def("address", &W8A8Weight::address);
  m.def(
      "quantize_per_token(Tensor x, int padded_k) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)",
        &quantize_per_token);
  m.def(
      "w8a8_apply(__torch__.torch.classes.plugserve_w8a8.W8A8Weight weight, Tensor x, "
      "ScalarType out_dtype, int kernel) -> Tensor",
      &w8a8_apply);
  m.def("amx_available() -> bool", &amx_available);
  m.def("linear_call_address() -> int", &linear_call_address);
}

#endif
