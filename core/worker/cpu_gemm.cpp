// Registers cpu_gemm.h's bf16 matmul as torch.ops.plugserve_gemm.linear_bf16; built and
// loaded by cpu_linear.py. Only where the CPU has AVX512_BF16 (else it registers nothing).
#include <torch/library.h>

#include "cpu_gemm.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

TORCH_LIBRARY(plugserve_gemm, m) {
  m.def("linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(plugserve_gemm, CPU, m) { m.impl("linear_bf16", &plugserve::linear_bf16); }

#endif
