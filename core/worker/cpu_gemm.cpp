// Registers cpu_gemm.h's bf16 matmul as torch.ops.plugserve_gemm.linear_bf16; built and
// loaded by cpu_linear.py. Only where the CPU has AVX512_BF16 (else it registers nothing).
#include <torch/library.h>

#include "cpu_gemm.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

namespace plugserve {

RowPool* shared_row_pool() {
  static RowPool* pool = new RowPool();  // never deleted: its helper outlives static teardown
  return pool;
}

}  // namespace plugserve

namespace {

// The pool's address, for the other libraries that run jobs on it (row_pool.h's
// lookup_row_pool: cpu_decoder.cpp, the CPU paged attention plugin).
int64_t row_pool_address() { return reinterpret_cast<int64_t>(plugserve::shared_row_pool()); }

void row_pool_set_enabled(bool enabled) { plugserve::shared_row_pool()->set_enabled(enabled); }
bool row_pool_enabled() { return plugserve::shared_row_pool()->enabled(); }

// For tests of the pool's hand-over (row_pool.h).
void row_pool_stall_helper_once(int64_t microseconds) {
  plugserve::shared_row_pool()->stall_helper_once(microseconds);
}
int64_t row_pool_items_taken_over() { return plugserve::shared_row_pool()->items_taken_over(); }
int64_t row_pool_jobs_shared() { return plugserve::shared_row_pool()->jobs_shared(); }

}  // namespace

TORCH_LIBRARY(plugserve_gemm, m) {
  m.def(
      "linear_bf16(Tensor x, Tensor packed, int out_features, Tensor? bias, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def("row_pool_address() -> int", &row_pool_address);
  m.def("row_pool_set_enabled(bool enabled) -> ()", &row_pool_set_enabled);
  m.def("row_pool_enabled() -> bool", &row_pool_enabled);
  m.def("row_pool_stall_helper_once(int microseconds) -> ()", &row_pool_stall_helper_once);
  m.def("row_pool_items_taken_over() -> int", &row_pool_items_taken_over);
  m.def("row_pool_jobs_shared() -> int", &row_pool_jobs_shared);
}

TORCH_LIBRARY_IMPL(plugserve_gemm, CPU, m) { m.impl("linear_bf16", &plugserve::linear_bf16); }

#endif
