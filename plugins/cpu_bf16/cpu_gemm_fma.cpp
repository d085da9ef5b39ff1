// bf16 matmul on fp32 FMA register tiles (core's cpu_fma_tiles.h: AVX-512F's 16-float
// vectors, else AVX2's 8): the weight packed once, bf16, into panels and widened to fp32 in
// registers; x widened once a call; products and sums in fp32, the output rounded to bf16
// (or kept fp32: the LM head's logits). Registered as torch.ops.plugserve_gemm_fma.
// pack_weight / linear_bf16, built and loaded by cpu_features.py where the CPU has avx2
// and fma.
//
// Two kinds of CPU run their bf16 matmuls fastest here: those without AVX512_BF16
// (cpu_gemm.cpp's instruction), where ATen converts at every call and runs a prefill's row
// counts far slower than fp32 (docs/benchmarks-history.md, "bf16 on AVX2"), and
// those whose fp32 FMA outruns their VDPBF16PS ("bf16 on fp32 FMA tiles").
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_fma_tiles.h"

#ifdef PLUGSERVE_HAS_FMA_TILES

namespace {

// weight [N, K] bf16 → [ceil(N/kPanel), K, kPanel] bf16, the columns past N zero.
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be bfloat16 [out_features, in_features]");
  return plugserve::fma::pack_panels(weight);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [rows, in_features]");
  const float* bias_data = plugserve::fma::checked_bias(packed, at::kBFloat16, x.size(1),
                                                         out_features, bias);
  const int64_t rows = x.size(0), k_total = packed.size(1), panels = packed.size(0);
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32");
  // x widened once: each of its values is broadcast against every panel.
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(dtype));
  if (dtype == at::kFloat) {
    plugserve::fma::linear_rows<uint16_t, float>(x32.data_ptr<float>(), k_total, rows, wp,
                                                  panels, k_total, bias_data,
                                                  out.data_ptr<float>(), out_features);
  } else {
    plugserve::fma::linear_rows<uint16_t, uint16_t>(
        x32.data_ptr<float>(), k_total, rows, wp, panels, k_total, bias_data,
        reinterpret_cast<uint16_t*>(out.data_ptr()), out_features);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(plugserve_gemm_fma, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def(
      "linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias, "
      "ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(plugserve_gemm_fma, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("linear_bf16", &linear_bf16);
}

#endif
