// fp32 math on 16 AVX-512 lanes for plugserve's CPU kernels (the elementwise ops, the
// prefill attention plugin). Public (plugserve.ops): kernels built by plugserve.ops.load
// find it on their include path. Defined only where the compiler targets AVX-512F.
#pragma once

#if defined(__AVX512F__)
#define PLUGSERVE_HAS_VEC_MATH 1
#include <immintrin.h>

#include "cpu_bf16.h"

namespace plugserve {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Rounded to nearest even with NaN kept a quiet NaN: cpu_bf16.h's store, 16 at a time.
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// exp(x) for 16 lanes: 2^n * poly(r), x = n ln2 + r; about 1 ulp over [-87, 88], 0 below
// -87 (a softmax's masked scores, SiLU's far negative inputs).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(~zero, p, n);
}

// cap * tanh(s / cap), through tanh|y| = (1 - e^-2|y|) / (1 + e^-2|y|).
inline __m512 soft_cap16(__m512 s, float cap) {
  __m512 y = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / cap));
  __m512 a = _mm512_abs_ps(y);
  __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  // tanh's sign is y's: copy y's sign bit onto t.
  __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0x80000000));
  t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// SiLU(g) * u = g / (1 + e^-g) * u for 16 lanes.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

}  // namespace plugserve

#endif
