// bf16 matmul on AMX tiles over cpu_gemm.h's k-pair-packed weights: out = x @ W.T (+ bias).
//
// A 64-byte row of the packed layout [N/16][K/2][16][2] is one k-pair of 16 output columns,
// which is exactly a row of an AMX B tile (TDPBF16PS's VNNI pairs): 16 consecutive k-pairs
// of a block are one B tile, read in place with a 64-byte stride. x needs no repacking
// either: an A tile is 16 rows of 32 consecutive k. So the same weights serve the vector
// kernel and this one, and a plan may give batches to whichever measures faster (at a few
// dozen rows the vector kernel is compute-bound where this one is still memory-bound).
//
// Per work item, two 16-column blocks against up to 32 rows: C tiles tmm0-3 (row tile r,
// block c at tmm 2r + c), A tiles tmm4-5, B tiles tmm6-7. More rows run again from the top
// (the weights then come from cache). K must be a multiple of 32 (amx_supported says).
// Defined only where the compiler targets AMX-BF16 (PLUGSERVE_HAS_AMX_GEMM); the kernel also
// needs the kernel's permission to use the tile state, asked once (amx_usable).
// Included by cpu_gemm.h, after the helpers it shares (store16).
#pragma once

#if defined(PLUGSERVE_HAS_BF16_GEMM) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PLUGSERVE_HAS_AMX_GEMM 1

#include <sys/syscall.h>
#include <unistd.h>

namespace plugserve {

// Linux's arch_prctl request for a feature's state, and the AMX tile data feature.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Whether this process may run AMX instructions (asked of the kernel once).
inline bool amx_usable() {
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

// Tiles for row tiles of m0 and m1 rows (m1 = 0: one row tile) and two column blocks.
// A tile left unused has 0 rows and 0 bytes a row: anything else faults in ldtilecfg.
inline void configure_tiles(int m0, int m1) {
  TileConfig config;
  for (int r = 0; r < 2; ++r) {
    const int m = r == 0 ? m0 : m1;
    const uint16_t bytes = m > 0 ? 64 : 0;
    for (int c = 0; c < 2; ++c) {
      config.rows[2 * r + c] = static_cast<uint8_t>(m);  // C: m rows of 16 fp32
      config.colsb[2 * r + c] = bytes;
    }
    config.rows[4 + r] = static_cast<uint8_t>(m);  // A: m rows of 32 bf16
    config.colsb[4 + r] = bytes;
  }
  for (int c = 0; c < 2; ++c) {
    config.rows[6 + c] = 16;  // B: 16 k-pairs of 16 columns
    config.colsb[6 + c] = 64;
  }
  _tile_loadconfig(&config);
}

// Rows [row0, row0 + m0 + m1) of out, columns of blocks b0 and b0 + 1 (nb: 1 or 2 of them).
template <typename Out>
void amx_item(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t block_stride,
              int64_t pairs, const float* bias, Out* out, int64_t out_stride, int64_t n,
              int64_t b0, int nb, int m0, int m1) {
  _tile_zero(0);
  if (nb > 1) _tile_zero(1);
  if (m1 > 0) _tile_zero(2);
  if (m1 > 0 && nb > 1) _tile_zero(3);
  const uint16_t* w0 = w + b0 * block_stride;
  const uint16_t* w1 = w0 + block_stride;
  const int64_t x_bytes = x_stride * 2;
  for (int64_t kp = 0; kp < pairs; kp += 16) {
    const uint16_t* a = x + 2 * kp;
    _tile_loadd(4, a, x_bytes);
    _tile_loadd(6, w0 + kp * 32, 64);
    if (nb > 1) _tile_loadd(7, w1 + kp * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nb > 1) _tile_dpbf16ps(1, 4, 7);
    if (m1 > 0) {
      _tile_loadd(5, a + 16 * x_stride, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if (nb > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[16][16];
  for (int r = 0; r < (m1 > 0 ? 2 : 1); ++r) {
    const int m = r == 0 ? m0 : m1;
    for (int c = 0; c < nb; ++c) {
      // The tile index must be a constant: one store per (r, c).
      if (r == 0 && c == 0) _tile_stored(0, sums, 64);
      if (r == 0 && c == 1) _tile_stored(1, sums, 64);
      if (r == 1 && c == 0) _tile_stored(2, sums, 64);
      if (r == 1 && c == 1) _tile_stored(3, sums, 64);
      const int64_t col = (b0 + c) * 16;
      const int64_t valid = std::min<int64_t>(16, n - col);
      const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
      const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
      for (int i = 0; i < m; ++i)
        store16(out + (16 * r + i) * out_stride + col, mask,
                _mm512_add_ps(_mm512_load_ps(sums[i]), bias_v));
    }
  }
}

// Rows of x a thread takes at a time: a panel of x small enough to stay in its core's L2
// while every column block of the thread's share reads it (read from L3 instead, as the
// whole of a long prompt's x would be, the tiles wait on the loads).
inline int64_t amx_panel_rows(int64_t pairs) {
  constexpr int64_t kPanelBytes = int64_t(512) << 10;
  return std::max<int64_t>(32, kPanelBytes / (pairs * 4) / 32 * 32);
}

// x [rows, K] bf16 (row stride x_stride) @ packed (+ bias) → out [rows, n].
template <typename Out>
void linear_rows_amx(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* w,
                     int64_t blocks, int64_t pairs, const float* bias, Out* out, int64_t n) {
  const int64_t block_stride = pairs * 32;
  const int64_t items = (blocks + 1) / 2;
  const int64_t panel_rows = amx_panel_rows(pairs);
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    int configured = -1;  // m0 * 64 + m1 of the tiles this thread configured
    // Panel, then item, then the panel's rows: an item's two blocks stay in L1/L2 while
    // the panel's row chunks read them, and the panel stays in L2 while the items do.
    // Each row's sums run over k in the same order whatever the row count.
    for (int64_t p = 0; p < rows; p += panel_rows) {
      const int64_t p_end = std::min(rows, p + panel_rows);
      for (int64_t item = first; item < last; ++item) {
        const int64_t b0 = 2 * item;
        const int nb = b0 + 1 < blocks ? 2 : 1;
        for (int64_t r = p; r < p_end; r += 32) {
          const int m0 = static_cast<int>(std::min<int64_t>(16, p_end - r));
          const int m1 = static_cast<int>(std::clamp<int64_t>(p_end - r - 16, 0, 16));
          if (configured != m0 * 64 + m1) {
            configure_tiles(m0, m1);
            configured = m0 * 64 + m1;
          }
          amx_item<Out>(x + r * x_stride, x_stride, w, block_stride, pairs, bias,
                        out + r * n, n, n, b0, nb, m0, m1);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace plugserve

#endif
