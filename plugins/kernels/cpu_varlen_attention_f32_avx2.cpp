// Bidirectional varlen attention in fp32 for CPUs with AVX2 and FMA (and no AVX-512F,
// which cpu_varlen_attention_f32.cpp serves): an encoder's step, whole prompts side by
// side, each query attending to every key of its own prompt.
//
// The same algorithm as the AVX-512F kernel in 8-float vectors: a work item (prompt,
// query head, chunk of query tokens) packs the head's keys as groups of 8 keys, each
// [D][8], so that a score tile is one FMA per (row, dimension) against 8 keys at once;
// scores a tile of query rows against all the prompt's keys; takes an exact softmax in
// fp32; and accumulates P·V reading v's rows where they lie. The checks, the packed keys'
// buffer and the work items are varlen_attention_host.h's.
//
// Registered as torch.ops.plugserve_varlen_f32_avx2.varlen_bidirectional(q, k, v,
// cu_seqlens, scale, softcap), the shapes in varlen_attention_host.h. Built and loaded by
// cpu_prefill_attention.py, which checks the CPU has avx2 and fma first.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "varlen_attention_host.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using plugserve::varlen::Layout;
using plugserve::varlen::Prompt;

// The loops over a tile's rows and vectors are unrolled by pragma: left to itself, GCC
// keeps the sums in memory and stores each back at every step of the loop around them.
constexpr int kScoreRows = 8;  // query rows per tile: 8 independent FMA chains
constexpr int kValueSums = 12;  // P·V accumulators a tile keeps in the 16 registers

// exp(x) for 8 lanes: 2^n * poly(r), x = n ln2 + r; about 1 ulp over [-87, 88], 0 below
// -87 (cpu_vec_math.h's exp16 in 8 lanes, 2^n built in the exponent's bits).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n in the exponent's bits: the clamp keeps n in [-126, 127], a normal float's range.
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, two_n));
}

// cap * tanh(s / cap), through tanh|y| = (1 - e^-2|y|) / (1 + e^-2|y|).
inline __m256 soft_cap8(__m256 s, float cap) {
  const __m256 y = _mm256_mul_ps(s, _mm256_set1_ps(1.0f / cap));
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, y), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  // tanh's sign is y's: copy y's sign bit onto t.
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign_bit)), _mm256_set1_ps(cap));
}

// The first `live` of 8 lanes.
inline __m256i lanes_below(int64_t live) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(live, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// keys [L, D] (token stride `stride`) → kp: groups of 8 keys, each [D][8], zero past L.
// Copied a key at a time: AVX2's gathers of 8 lanes cost more than these scalar moves.
void pack_keys(const float* k, int64_t stride, int64_t L, int64_t D, float* kp) {
  for (int64_t g = 0; g * 8 < L; ++g) {
    const int64_t live = std::min<int64_t>(8, L - g * 8);
    float* dst = kp + g * 8 * D;
    for (int64_t j = 0; j < 8; ++j) {
      const float* key = k + (g * 8 + j) * stride;
      for (int64_t d = 0; d < D; ++d) dst[d * 8 + j] = j < live ? key[d] : 0.0f;
    }
  }
}

// s[r][0..8 groups) = scale * q[r] · keys, soft-capped where asked; q rows given by pointer
// (a short tile repeats its last row: computed, never stored).
void score_rows(const float* const* q, const float* kp, int64_t groups, int64_t D,
                const Layout& lay, float* s, int64_t s_stride) {
  const __m256 scale = _mm256_set1_ps(lay.scale);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[kScoreRows];
    #pragma GCC unroll 16
    for (int r = 0; r < kScoreRows; ++r) acc[r] = _mm256_setzero_ps();
    const float* kg = kp + g * 8 * D;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 keys = _mm256_loadu_ps(kg + d * 8);
      #pragma GCC unroll 16
      for (int r = 0; r < kScoreRows; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[r] + d), keys, acc[r]);
    }
    #pragma GCC unroll 16
    for (int r = 0; r < kScoreRows; ++r) {
      __m256 x = _mm256_mul_ps(acc[r], scale);
      if (lay.softcap > 0) x = soft_cap8(x, lay.softcap);
      _mm256_storeu_ps(s + r * s_stride + g * 8, x);
    }
  }
}

inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float reduce_add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// s[0..L) → its softmax's numerators e^(s - max), in place (zero on the padded lanes after
// L); returns 1 / their sum.
float exp_row(float* s, int64_t L) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::max());
  __m256 peak = lowest;
  for (int64_t i = 0; i < L; i += 8) {
    const __m256 live = _mm256_castsi256_ps(lanes_below(L - i));
    peak = _mm256_max_ps(peak, _mm256_blendv_ps(lowest, _mm256_loadu_ps(s + i), live));
  }
  const __m256 m = _mm256_set1_ps(reduce_max8(peak));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < L; i += 8) {
    const __m256 live = _mm256_castsi256_ps(lanes_below(L - i));
    const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + i, e);
  }
  return 1.0f / reduce_add8(sum);
}

// out[r][c0 .. c0 + 8 NV) = inv[r] * Σ_t p[r][t] v[t][c0 ..] for R rows; R * NV sums.
template <int R, int NV>
void value_rows(const float* const* p, const float* v, int64_t v_stride, int64_t L,
                const float* inv, float* const* out, int64_t c0) {
  __m256 acc[R][NV];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m256 vv[NV];
    #pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) vv[c] = _mm256_loadu_ps(v + t * v_stride + c0 + c * 8);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p[r] + t);
      #pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    if (out[r] != nullptr)
      #pragma GCC unroll 16
      for (int c = 0; c < NV; ++c)
        _mm256_storeu_ps(out[r] + c0 + c * 8, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r])));
}

// Query tokens [t0, t0 + n) of head h of one prompt, D = 8 * ND; s is this thread's score
// buffer. P·V runs R rows at a time over NV of the D / 8 vectors, NV * R <= kValueSums.
template <int ND>
void attend_chunk(const Prompt& P, const Layout& lay, int64_t h, int64_t t0, int64_t n,
                  std::vector<float>& s) {
  constexpr int NV = std::min(ND, 8);
  constexpr int R = std::max(1, kValueSums / NV);
  const int64_t D = lay.D, L = P.len, groups = (L + 7) / 8, s_stride = groups * 8;
  const int64_t kv_head = h / (lay.H / lay.KVH);
  s.resize(kScoreRows * s_stride);
  const float* kp = P.kp + kv_head * s_stride * D;
  const float* v = P.v + kv_head * D;
  for (int64_t r0 = t0; r0 < t0 + n; r0 += kScoreRows) {
    const int64_t rows = std::min<int64_t>(kScoreRows, t0 + n - r0);
    const float* q[kScoreRows];
    #pragma GCC unroll 16
    for (int r = 0; r < kScoreRows; ++r)
      q[r] = P.q + (r0 + std::min<int64_t>(r, rows - 1)) * lay.q_stride + h * D;
    score_rows(q, kp, groups, D, lay, s.data(), s_stride);
    float inv[kScoreRows + R] = {};
    for (int64_t r = 0; r < rows; ++r) inv[r] = exp_row(s.data() + r * s_stride, L);
    for (int64_t r = 0; r < rows; r += R) {
      const float* p[R];
      float* out[R];
      for (int i = 0; i < R; ++i) {
        const bool real = r + i < rows;  // past the tile's rows: its last, computed, not stored
        p[i] = s.data() + (real ? r + i : rows - 1) * s_stride;
        out[i] = real ? P.out + (r0 + r + i) * lay.H * D + h * D : nullptr;
      }
      for (int64_t c0 = 0; c0 < D; c0 += 8 * NV)
        value_rows<R, NV>(p, v, lay.v_stride, L, inv + r, out, c0);
    }
  }
}

at::Tensor varlen_bidirectional(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::IntArrayRef cu_seqlens, double scale, double softcap) {
  const auto attend = [](const Prompt& P, const Layout& lay, int64_t h, int64_t t0, int64_t n,
                         std::vector<float>& s) {
    if (lay.D == 32)
      attend_chunk<4>(P, lay, h, t0, n, s);
    else if (lay.D == 64)
      attend_chunk<8>(P, lay, h, t0, n, s);
    else
      attend_chunk<16>(P, lay, h, t0, n, s);
  };
  return plugserve::varlen::bidirectional<8>(q, k, v, cu_seqlens, scale, softcap, pack_keys,
                                             attend);
}

}  // namespace

TORCH_LIBRARY(plugserve_varlen_f32_avx2, m) {
  m.def(
      "varlen_bidirectional(Tensor q, Tensor k, Tensor v, int[] cu_seqlens, float scale, "
      "float softcap) -> Tensor",
      &varlen_bidirectional);
}

#endif
