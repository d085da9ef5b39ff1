// int8 weight-only linear for AVX-512 CPUs: y = (x @ q.T) * scale + bias.
//
// q: int8 [N, K], one fp32 scale per output row (symmetric: w ≈ q * scale). x: bf16 or
// fp32 [M, K].
//
// Few rows (M <= kSmallRows): the weights are dequantized in registers (int8 -> int32 ->
// fp32), each converted weight vector serving every row of x, four output rows at a time,
// accumulated in fp32 and scaled once at the end. A step then reads one byte a weight,
// half of what the bf16 kernels read. One row splits its output over the process's row
// pool (row_pool.h) where that is on, else over OpenMP like the others.
//
// More rows: each thread dequantizes a block of weight rows (to bf16, or fp32 for fp32
// output) and multiplies it with ATen's matmul (oneDNN); there the matmul's arithmetic, not
// reading the weights, is the cost.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "row_pool.h"

namespace {

constexpr int64_t kSmallRows = 8;   // up to this many rows: dequantize in registers
constexpr int64_t kRowsPerStep = 4;  // output rows computed together
constexpr int64_t kRowsPerItem = 32;  // output rows per parallel item
constexpr int64_t kBlockRows = 64;  // weight rows dequantized at a time (larger M)

inline __m512 load_weights(const int8_t* q, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q)));
}

// Output rows [n0, n0 + rows) (rows <= kRowsPerStep) for the M rows of fp32 x (row
// stride K), as fp32 into acc_out[m * kRowsPerStep + r], unscaled.
template <int M>
inline void dot_rows(const int8_t* q, int64_t K, int64_t n0, int64_t rows, const float* x,
                     float* acc_out) {
  __m512 acc[M][kRowsPerStep];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRowsPerStep; ++r) acc[m][r] = _mm512_setzero_ps();
  const int8_t* row[kRowsPerStep];
  for (int r = 0; r < kRowsPerStep; ++r) row[r] = q + (n0 + std::min<int64_t>(r, rows - 1)) * K;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 w[kRowsPerStep];
    for (int r = 0; r < kRowsPerStep; ++r) w[r] = load_weights(row[r] + k, mask);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < kRowsPerStep; ++r) acc[m][r] = _mm512_fmadd_ps(w[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRowsPerStep; ++r)
      acc_out[m * kRowsPerStep + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <typename Out>
inline void store(Out* out, float v) {
  if constexpr (std::is_same_v<Out, float>) {
    *out = v;
  } else {
    *out = c10::BFloat16(v);  // round to nearest even
  }
}

struct SmallArgs {
  const int8_t* q;
  const float* scale;
  const float* bias;  // fp32 or nullptr
  const float* x;  // fp32 [M, K]
  int64_t M, K, N;
  int64_t out_stride;  // elements between rows of out
};

// Output rows [n_begin, n_end) of every row of x into out (out[m * out_stride + n - n_begin]).
template <typename Out, int M>
void small_block(const SmallArgs& a, int64_t n_begin, int64_t n_end, Out* out) {
  float acc[M * kRowsPerStep];
  for (int64_t n = n_begin; n < n_end; n += kRowsPerStep) {
    const int64_t rows = std::min(kRowsPerStep, n_end - n);
    dot_rows<M>(a.q, a.K, n, rows, a.x, acc);
    for (int64_t r = 0; r < rows; ++r) {
      const float s = a.scale[n + r], b = a.bias ? a.bias[n + r] : 0.0f;
      for (int m = 0; m < M; ++m)
        store(out + m * a.out_stride + (n - n_begin) + r, acc[m * kRowsPerStep + r] * s + b);
    }
  }
}

template <typename Out, int M>
void small_rows(const SmallArgs& a, Out* out) {
  at::parallel_for(0, (a.N + kRowsPerItem - 1) / kRowsPerItem, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRowsPerItem, n1 = std::min(a.N, b1 * kRowsPerItem);
    small_block<Out, M>(a, n0, n1, out + n0);
  });
}

// One row through the row pool: item i is output rows [i * kRowsPerItem, ...).
template <typename Out>
void one_row_item(const void* args, int64_t item, void* out) {
  const auto& a = *static_cast<const SmallArgs*>(args);
  const int64_t n0 = item * kRowsPerItem, n1 = std::min(a.N, n0 + kRowsPerItem);
  small_block<Out, 1>(a, n0, n1, static_cast<Out*>(out));
}

template <typename Out>
void small(const SmallArgs& a, Out* out, const at::Tensor& q, const at::Tensor& x) {
  if (a.M == 1) {
    plugserve::RowPool* pool = plugserve::lookup_row_pool();
    const int64_t items = (a.N + kRowsPerItem - 1) / kRowsPerItem;
    if (pool != nullptr && pool->enabled()) {
      const int64_t item_bytes = kRowsPerItem * sizeof(Out);
      const int64_t last = (a.N - (items - 1) * kRowsPerItem) * sizeof(Out);
      pool->run(plugserve::RowPool::make_job(&one_row_item<Out>, a, items, out, item_bytes, last,
                                             {q, x, at::Tensor(), at::Tensor()}));
      return;
    }
  }
  // Rows of x in groups of at most four, each group one pass over the weights.
  for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
    SmallArgs part = a;
    part.x = a.x + m0 * a.K;
    part.M = std::min<int64_t>(4, a.M - m0);
    Out* o = out + m0 * a.out_stride;
    switch (part.M) {
      case 1: small_rows<Out, 1>(part, o); break;
      case 2: small_rows<Out, 2>(part, o); break;
      case 3: small_rows<Out, 3>(part, o); break;
      default: small_rows<Out, 4>(part, o); break;
    }
  }
}

// Larger M: per block of weight rows, dequantize and run ATen's matmul on the block. bf16
// output: bf16 weights (q * scale rounded once) and oneDNN's bf16 matmul. fp32 output (the
// LM head's logits): fp32 weights and matmul, so that logits are not rounded to bf16.
void large(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
           const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t N = q.size(0), K = q.size(1);
  const at::ScalarType compute = out.scalar_type();
  const at::Tensor xc = x.to(compute);
  // The worker threads do not inherit the caller's inference mode, which writing into
  // `out` (an inference tensor under the engine) needs.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, (N + kBlockRows - 1) / kBlockRows, 1, [&](int64_t b0, int64_t b1) {
    c10::InferenceMode guard(inference);
    at::Tensor block = at::empty({kBlockRows, K}, x.options().dtype(at::kFloat));
    float* w = block.data_ptr<float>();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlockRows, rows = std::min(kBlockRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* src = q.data_ptr<int8_t>() + (n0 + r) * K;
        const float s = scale.data_ptr<float>()[n0 + r];
        for (int64_t k = 0; k < K; ++k) w[r * K + k] = float(src[k]) * s;
      }
      at::Tensor y = at::mm(xc, block.narrow(0, 0, rows).to(compute).t());
      if (bias.has_value()) y = y.to(at::kFloat) + bias->narrow(0, n0, rows);
      out.narrow(1, n0, rows).copy_(y);
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: shapes");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "int8_linear: scale");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "int8_linear: out dtype");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0) return out;
  c10::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
  if (M > kSmallRows) {
    large(x, q, scale, bias32, out);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  SmallArgs a{q.data_ptr<int8_t>(),
              scale.data_ptr<float>(),
              bias32.has_value() ? bias32->data_ptr<float>() : nullptr,
              xf.data_ptr<float>(),
              M,
              K,
              N,
              N};
  if (out_dtype == at::kFloat)
    small<float>(a, out.data_ptr<float>(), q, xf);
  else
    small<c10::BFloat16>(a, out.data_ptr<c10::BFloat16>(), q, xf);
  return out;
}

}  // namespace

TORCH_LIBRARY(plugserve_int8, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, ScalarType out_dtype) -> Tensor",
        &int8_linear);
}
