// The elementwise kernels of a bf16/fp32 transformer layer on CPU: a decoder's RMSNorm
// (with the residual add, or over each head of q and k), neox RoPE in place and SiLU(gate)
// * up; an encoder's GELU in place (bf16, by table) and LayerNorm over the residual add.
// One pass each, in fp32, rounded once on store. Core's cpu_ops.cpp registers them as ops;
// a plugin's fused decoder (the bf16 CPU fast path's cpu_decoder.cpp) runs them inside
// its own ops; both check their arguments with the checks at the end. Public: in namespace
// plugserve, included as "cpu_ops.h" (plugserve.ops' docstring).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_bf16.h"
#include "cpu_vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace plugserve {

// Rows per task: enough work that a task outweighs handing it to another thread.
inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements));
}

template <typename T>
inline float inverse_rms(const T* x, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * x_stride;
      T* dst = op + r * out_stride;
      const float scale = inverse_rms(row, n, static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i) store(dst + i, to_float(row[i]) * scale * to_float(wp[i]));
    }
  });
}

// residual += x (rounded to T, as an unfused add would store it); x = rms_norm(residual).
template <typename T>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * x_stride;
      T* rr = rp + r * r_stride;
      for (int64_t i = 0; i < n; ++i) store(rr + i, to_float(xr[i]) + to_float(rr[i]));
      const float scale = inverse_rms(rr, n, static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i) store(xr + i, to_float(rr[i]) * scale * to_float(wp[i]));
    }
  });
}

// In place: each of the heads [first_head, first_head + num_heads) of every row of x,
// x / rms(x) * weight over its head_dim values (Qwen3's q/k norm, weight [head_dim] shared
// by the heads).
template <typename T>
void rms_norm_heads_impl(at::Tensor& x, const at::Tensor& weight, double eps, int64_t first_head,
                         int64_t num_heads, int64_t head_dim) {
  const int64_t rows = x.size(0), row_stride = x.stride(0);
  T* base = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = first_head; h < first_head + num_heads; ++h) {
        T* head = base + r * row_stride + h * head_dim;
        const float scale = inverse_rms(head, head_dim, static_cast<float>(eps));
        for (int64_t i = 0; i < head_dim; ++i)
          store(head + i, to_float(head[i]) * scale * to_float(wp[i]));
      }
    }
  });
}

// Rotates the first num_heads heads of each row of qk in place (rotate-half / neox form):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of the head's first
// rotary_dim dimensions (cos_sin's width: all of them, or a partial rotary factor's part),
// the rest passed through.
template <typename T>
void rotary_embedding_impl(at::Tensor& qk, const at::Tensor& positions, const at::Tensor& cos_sin,
                           int64_t num_heads, int64_t head_dim) {
  const int64_t rows = qk.size(0), rotary_dim = cos_sin.size(1), half = rotary_dim / 2;
  const int64_t max_positions = cos_sin.size(0);
  T* base = qk.data_ptr<T>();
  const int64_t row_stride = qk.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_positions, "position ", pos[r],
                " is outside the RoPE table (", max_positions, " positions)");
  at::parallel_for(0, rows, grain(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cos = table + pos[r] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = base + r * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          store(x + i, x1 * cos[i] - x2 * sin[i]);
          store(x + i + half, x2 * cos[i] + x1 * sin[i]);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t in_stride = gate_up.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * in_stride;
      const T* up = gate + n;
      T* dst = op + r * out_stride;
      int64_t i = 0;
#ifdef PLUGSERVE_HAS_VEC_MATH
      // 16 at a time: the scalar loop's std::exp made SiLU a visible share of a prefill
      // step (docs/benchmarks-history.md, "bf16 CPU kernels by row count").
      for (; i + 16 <= n; i += 16) store16(dst + i, silu_mul16(load16(gate + i), load16(up + i)));
#endif
      for (; i < n; ++i) {
        const float g = to_float(gate[i]);
        // Clamped as exp16 clamps: under -ffast-math an infinite exp is undefined, and
        // g / (1 + exp(-g)) came out NaN for g below about -88.
        const float e = std::exp(std::min(std::max(-g, -87.0f), 88.0f));
        store(dst + i, g / (1.0f + e) * to_float(up[i]));
      }
    }
  });
}

// The value of a finite bf16 bit pattern, decoded with integer arithmetic: a subnormal
// widened through float reads as zero on a thread with DAZ set, and GCC's crtfastmath sets
// FTZ/DAZ on the thread that loads a -ffast-math library (this one included).
inline double bf16_finite_value(uint16_t bits) {
  const int exponent = (bits >> 7) & 0xFF, fraction = bits & 0x7F;
  const double magnitude = exponent == 0 ? std::ldexp(fraction, -133)
                                         : std::ldexp(0x80 | fraction, exponent - 134);
  return (bits & 0x8000) ? -magnitude : magnitude;
}

// The bf16 bit pattern (sign bit clear) nearest to a finite magnitude >= 0, ties to even:
// rounded once from double, with no float in between (that would round twice, and flush
// subnormals under FTZ).
inline uint16_t bf16_nearest_magnitude_bits(double magnitude) {
  if (magnitude == 0.0) return 0;
  int exponent;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  // 8 significant bits, and no unit finer than the subnormal step 2^-133.
  const int unit = std::max(exponent - 8, -133);
  const auto units = static_cast<uint32_t>(std::nearbyint(std::ldexp(magnitude, -unit)));
  // A subnormal's pattern is its count of 2^-133 units; a normal's is its biased exponent
  // then 7 fraction bits, where a count rounded up to 256 carries into the exponent.
  const uint32_t pattern = unit == -133 ? units : ((exponent + 126) << 7) + units - 128;
  return static_cast<uint16_t>(std::min<uint32_t>(pattern, 0x7F80));
}

// GELU of a bf16 bit pattern, as a bf16 bit pattern: the erf form x/2 erfc(-x / sqrt 2)
// or the tanh form x sigmoid(2y), which keep their accuracy where 1 + erf and 1 + tanh
// cancel (x far below zero). +inf gives +inf; -inf gives NaN (-inf * 0, as ATen's GELU);
// a NaN stays itself. Only finite doubles occur: infinities are undefined under
// -ffast-math.
inline uint16_t gelu_bf16_bits(uint16_t bits, bool tanh_form) {
  if (((bits >> 7) & 0xFF) == 0xFF) {
    const bool negative_infinity = bits == 0xFF80;
    return negative_infinity ? 0xFFC0 : bits;
  }
  const double v = bf16_finite_value(bits);
  double g;
  if (tanh_form) {
    const double t = 2.0 * 0.7978845608028654 * (v + 0.044715 * v * v * v);
    const double e = std::exp(-std::fabs(t));
    g = v * (t >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
  } else {
    g = 0.5 * v * std::erfc(-v * 0.7071067811865476);
  }
  // GELU(x) = x Phi(x) has x's sign, a zero's included: taken from the input, since
  // -ffast-math does not keep the sign of a zero.
  return (bits & 0x8000) | bf16_nearest_magnitude_bits(std::fabs(g));
}

// GELU of every bf16 value: the erf form's 65536 entries, one spare (a 4-byte read at the
// last index stays inside), then the tanh form's. A lookup is cheaper than evaluating erf
// in fp32, and exact for a bf16 input; the entries do not depend on the building thread's
// FTZ/DAZ.
constexpr int64_t kGeluTableEntries = 65537;

inline const uint16_t* gelu_bf16_table(bool tanh_form) {
  static const std::vector<uint16_t> tables = [] {
    std::vector<uint16_t> built(2 * kGeluTableEntries, 0);
    for (int form = 0; form < 2; ++form)
      for (uint32_t bits = 0; bits < 65536; ++bits)
        built[form * kGeluTableEntries + bits] = gelu_bf16_bits(bits, form == 1);
    return built;
  }();
  return tables.data() + (tanh_form ? kGeluTableEntries : 0);
}

// In place: x = GELU(x) over each row of bf16 x, through gelu_bf16_table.
inline void gelu_bf16_impl(at::Tensor& x, bool tanh_form) {
  const int64_t rows = x.size(0), n = x.size(1);
  auto* xp = reinterpret_cast<uint16_t*>(x.data_ptr<c10::BFloat16>());
  const int64_t stride = x.stride(0);
  const uint16_t* table = gelu_bf16_table(tanh_form);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* row = xp + r * stride;
      int64_t i = 0;
#ifdef PLUGSERVE_HAS_VEC_MATH
      for (; i + 16 <= n; i += 16) {
        const __m512i index =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
        const __m512i found = _mm512_i32gather_epi32(index, table, 2);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i), _mm512_cvtepi32_epi16(found));
      }
#endif
      for (; i < n; ++i) row[i] = table[row[i]];
    }
  });
}

// In place: x = LayerNorm(x + residual) * weight + bias over each row (a post-norm
// encoder's add and norm), the sum kept in fp32 for the statistics and the output.
template <typename T>
void add_layer_norm_impl(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                         const at::Tensor& bias, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias.data_ptr<T>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(n);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * x_stride;
      const T* rr = rp + r * r_stride;
      float total = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        sum[i] = to_float(xr[i]) + to_float(rr[i]);
        total += sum[i];
      }
      const float mean = total / static_cast<float>(n);
      float squares = 0.0f;
      for (int64_t i = 0; i < n; ++i) squares += (sum[i] - mean) * (sum[i] - mean);
      const float variance = squares / static_cast<float>(n);
      const float scale = 1.0f / std::sqrt(variance + static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i)
        store(xr + i, (sum[i] - mean) * scale * to_float(wp[i]) + to_float(bp[i]));
    }
  });
}

// Argument checks, shared by the ops that run these kernels.
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with a dense last dim");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// A norm's weight for rows x: contiguous [hidden] of x's dtype.
inline void check_norm_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] of x's dtype");
}

// Checks for a norm: `other` (out or residual) shaped and typed as x, weight [hidden].
inline void check_norm(const at::Tensor& x, const at::Tensor& other, const char* other_name,
                       const at::Tensor& weight) {
  check_rows(x, "x");
  check_rows(other, other_name);
  TORCH_CHECK(other.sizes() == x.sizes() && other.scalar_type() == x.scalar_type(), other_name,
              " must match x");
  check_norm_weight(weight, x);
}

// Checks for a LayerNorm over x + residual: residual shaped and typed as x, weight and
// bias [hidden] of x's dtype.
inline void check_add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                 const at::Tensor& weight, const at::Tensor& bias) {
  check_norm(x, residual, "residual", weight);
  TORCH_CHECK(bias.is_contiguous() && bias.numel() == x.size(1) &&
                  bias.scalar_type() == x.scalar_type(),
              "bias must be contiguous [hidden] of x's dtype");
}

// Checks for RoPE over the first num_heads heads of each row of qk.
inline void check_rotary(const at::Tensor& qk, const at::Tensor& positions,
                         const at::Tensor& cos_sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qk, "qk");
  TORCH_CHECK(qk.size(1) >= num_heads * head_dim, "qk rows must hold num_heads heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qk.size(0),
              "positions must be contiguous int64 [rows]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.dim() == 2 && cos_sin.size(1) % 2 == 0 && cos_sin.size(1) > 0 &&
                  cos_sin.size(1) <= head_dim,
              "cos_sin must be contiguous float32 [positions, rotary_dim], rotary_dim even "
              "and at most head_dim");
}

// Checks for a norm over heads [first_head, first_head + num_heads) of each row of x.
inline void check_norm_heads(const at::Tensor& x, const at::Tensor& weight, int64_t first_head,
                             int64_t num_heads, int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(first_head >= 0 && num_heads >= 0 && head_dim > 0 &&
                  (first_head + num_heads) * head_dim <= x.size(1),
              "x rows must hold heads [first_head, first_head + num_heads)");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == head_dim &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [head_dim] of x's dtype");
}

}  // namespace plugserve
