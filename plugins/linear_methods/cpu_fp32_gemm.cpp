// fp32 matmul in FMA register tiles (core's cpu_fma_tiles.h: AVX-512F's 16-float vectors,
// else AVX2's 8): out = x @ W.T (+ bias), for any row count;
// torch.ops.plugserve_fp32.pack_weight / linear, loaded by cpu_fp32.py (its kernel fma).
//
// On a CPU without AVX-512, oneDNN's fp32 matmul runs small row counts well below the
// cores' FMA rate, and one row well below the memory's (docs/benchmarks-history.md, "fp32
// on AVX2").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_fma_tiles.h"

#ifdef PLUGSERVE_HAS_FMA_TILES

namespace {

// weight [N, K] fp32 → [ceil(N/kPanel), K, kPanel], the columns past N zero.
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be float32 [out_features, in_features]");
  return plugserve::fma::pack_panels(weight);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "x must be float32 [rows, in_features] with a dense last dim");
  const float* bias_data = plugserve::fma::checked_bias(packed, at::kFloat, x.size(1),
                                                         out_features, bias);
  const int64_t rows = x.size(0), k_total = packed.size(1), panels = packed.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  plugserve::fma::linear_rows<float, float>(x.data_ptr<float>(), x.stride(0), rows,
                                             packed.data_ptr<float>(), panels, k_total,
                                             bias_data, out.data_ptr<float>(), out_features);
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
