// Bidirectional varlen attention in fp32 for CPUs with AVX-512F: an encoder's step, whole
// prompts side by side, each query attending to every key of its own prompt.
//
// A work item is (prompt, query head, chunk of query tokens). It packs the head's keys as
// groups of 16 keys, each [D][16], so that a score tile is one FMA per (row, dimension)
// against 16 keys at once; scores a tile of query rows against all the prompt's keys (an
// encoder runs a prompt in one step, so a prompt's scores fit a row buffer); takes an
// exact softmax in fp32; and accumulates P·V reading v's rows where they lie. The checks,
// the packed keys' buffer and the work items are varlen_attention_host.h's.
//
// Registered as torch.ops.plugserve_varlen_f32.varlen_bidirectional(q, k, v, cu_seqlens,
// scale, softcap), the shapes in varlen_attention_host.h. Built and loaded by
// cpu_prefill_attention.py, which checks the CPU has avx512f first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_vec_math.h"
#include "varlen_attention_host.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#if defined(PLUGSERVE_HAS_VEC_MATH)

using plugserve::exp16;
using plugserve::soft_cap16;

using plugserve::varlen::Layout;
using plugserve::varlen::Prompt;

constexpr int kScoreRows = 8;  // query rows per tile: 8 independent FMA chains

// keys [L, D] (token stride `stride`) → kp: groups of 16 keys, each [D][16], zero past L;
// each [16] gathered from the 16 keys' rows.
void pack_keys(const float* k, int64_t stride, int64_t L, int64_t D, float* kp) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(stride)));
  for (int64_t g = 0; g * 16 < L; ++g) {
    const int64_t left = L - g * 16;
    const __mmask16 live = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const float* first = k + g * 16 * stride;
    float* dst = kp + g * 16 * D;
    for (int64_t d = 0; d < D; ++d)
      _mm512_storeu_ps(dst + d * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows,
                                                              first + d, 4));
  }
}

// s[r][0..16 groups) = scale * q[r] · keys, soft-capped where asked; q rows given by pointer
// (a short tile repeats its last row: computed, never stored).
void score_rows(const float* const* q, const float* kp, int64_t groups, int64_t D,
                const Layout& lay, float* s, int64_t s_stride) {
  const __m512 scale = _mm512_set1_ps(lay.scale);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[kScoreRows];
    for (int r = 0; r < kScoreRows; ++r) acc[r] = _mm512_setzero_ps();
    const float* kg = kp + g * 16 * D;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 keys = _mm512_loadu_ps(kg + d * 16);
      for (int r = 0; r < kScoreRows; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), keys, acc[r]);
    }
    for (int r = 0; r < kScoreRows; ++r) {
      __m512 x = _mm512_mul_ps(acc[r], scale);
      if (lay.softcap > 0) x = soft_cap16(x, lay.softcap);
      _mm512_storeu_ps(s + r * s_stride + g * 16, x);
    }
  }
}

// s[0..L) → its softmax's numerators e^(s - max), in place; returns 1 / their sum.
float exp_row(float* s, int64_t L) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::max());
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 live = L - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (L - i)) - 1);
    peak = _mm512_mask_max_ps(peak, live, peak, _mm512_maskz_loadu_ps(live, s + i));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < L; i += 16) {
    const __mmask16 live = L - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (L - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(s + i, live, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// out[r] = inv[r] * Σ_t p[r][t] v[t] for R rows, D = 16 * ND; R * ND accumulators.
template <int R, int ND>
void value_rows(const float* p, int64_t p_stride, const float* v, int64_t v_stride, int64_t L,
                const float* inv, float* const* out) {
  __m512 acc[R][ND];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(v + t * v_stride + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * p_stride + t]);
      for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    if (out[r] != nullptr)
      for (int c = 0; c < ND; ++c)
        _mm512_storeu_ps(out[r] + c * 16, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
}

// Query tokens [t0, t0 + n) of head h of one prompt; s is this thread's score buffer.
template <int ND>
void attend_chunk(const Prompt& P, const Layout& lay, int64_t h, int64_t t0, int64_t n,
                  std::vector<float>& s) {
  constexpr int kValueRows = std::max(1, 16 / ND);  // R * ND accumulators within 32 registers
  const int64_t D = lay.D, L = P.len, groups = (L + 15) / 16, s_stride = groups * 16;
  const int64_t kv_head = h / (lay.H / lay.KVH);
  s.resize(kScoreRows * s_stride);
  const float* kp = P.kp + kv_head * s_stride * D;
  const float* v = P.v + kv_head * D;
  for (int64_t r0 = t0; r0 < t0 + n; r0 += kScoreRows) {
    const int64_t rows = std::min<int64_t>(kScoreRows, t0 + n - r0);
    const float* q[kScoreRows];
    for (int r = 0; r < kScoreRows; ++r)
      q[r] = P.q + (r0 + std::min<int64_t>(r, rows - 1)) * lay.q_stride + h * D;
    score_rows(q, kp, groups, D, lay, s.data(), s_stride);
    float inv[kScoreRows];
    for (int64_t r = 0; r < rows; ++r) inv[r] = exp_row(s.data() + r * s_stride, L);
    for (int64_t r = 0; r < rows; r += kValueRows) {
      float* out[kValueRows];
      for (int i = 0; i < kValueRows; ++i)
        out[i] = r + i < rows ? P.out + (r0 + r + i) * lay.H * D + h * D : nullptr;
      value_rows<kValueRows, ND>(s.data() + r * s_stride, s_stride, v, lay.v_stride, L,
                                 inv + r, out);
    }
  }
}

at::Tensor varlen_bidirectional(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::IntArrayRef cu_seqlens, double scale, double softcap) {
  const auto attend = [](const Prompt& P, const Layout& lay, int64_t h, int64_t t0, int64_t n,
                         std::vector<float>& s) {
    if (lay.D == 32)
      attend_chunk<2>(P, lay, h, t0, n, s);
    else if (lay.D == 64)
      attend_chunk<4>(P, lay, h, t0, n, s);
    else
      attend_chunk<8>(P, lay, h, t0, n, s);
  };
  return plugserve::varlen::bidirectional<16>(q, k, v, cu_seqlens, scale, softcap, pack_keys,
                                              attend);
}

#else  // no AVX-512F: the Python side never calls this build

at::Tensor varlen_bidirectional(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                at::IntArrayRef, double, double) {
  TORCH_CHECK(false, "fp32 varlen attention was built without AVX-512F");
}

#endif

}  // namespace

TORCH_LIBRARY(plugserve_varlen_f32, m) {
  m.def(
      "varlen_bidirectional(Tensor q, Tensor k, Tensor v, int[] cu_seqlens, float scale, "
      "float softcap) -> Tensor",
      &varlen_bidirectional);
}
