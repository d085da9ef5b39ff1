// The small ops of a transformer layer, fused for the CPU: a decoder's RMSNorm (with the
// residual add, or over each q and k head), neox RoPE in place and SiLU(gate) * up; an
// encoder's GELU in place and LayerNorm over the residual add; the greedy argmax over
// logits; and the process's one row pool (row_pool.h).
//
// Through ATen each of these is several passes over the activations plus a cast to fp32
// and back per pass; at decode sizes their cost is mostly per-op dispatch (a bf16
// F.rms_norm is ten ATen calls). Here each is one pass, in fp32, rounded once on store.
//
// Registered as torch.ops.plugserve_ops.*; built and loaded by core (worker/cpu_ops.py,
// the sampler) and by any plugin that runs these ops or the row pool. Rows are split over
// ATen's thread pool, so the ops share the threads torch already runs on.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"

#if defined(__x86_64__) && defined(__linux__)
#define PLUGSERVE_HAS_ROW_POOL 1
#include "row_pool.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef PLUGSERVE_HAS_ROW_POOL
namespace plugserve {

// The process's one pool: other libraries (a plugin's matmuls or attention) find it
// through the dispatcher (row_pool.h's lookup_row_pool), so whichever of them loads, it is
// this library's. Off until a plugin turns it on (row_pool_set_enabled: the bf16 CPU
// kernels do where OpenMP's threads spin briefly); its helper thread starts on first use.
RowPool* shared_row_pool() {
  static RowPool* pool = new RowPool();  // never deleted: its helper outlives static teardown
  return pool;
}

}  // namespace plugserve
#endif

namespace {

#ifdef PLUGSERVE_HAS_ROW_POOL
int64_t row_pool_address() { return reinterpret_cast<int64_t>(plugserve::shared_row_pool()); }

void row_pool_set_enabled(bool enabled) { plugserve::shared_row_pool()->set_enabled(enabled); }
bool row_pool_enabled() { return plugserve::shared_row_pool()->enabled(); }

// For tests of the pool's hand-over (row_pool.h).
void row_pool_stall_helper_once(int64_t microseconds) {
  plugserve::shared_row_pool()->stall_helper_once(microseconds);
}
void row_pool_release_helper() { plugserve::shared_row_pool()->release_helper(); }
int64_t row_pool_items_taken_over() { return plugserve::shared_row_pool()->items_taken_over(); }
int64_t row_pool_late_items_dropped() {
  return plugserve::shared_row_pool()->late_items_dropped();
}
int64_t row_pool_jobs_shared() { return plugserve::shared_row_pool()->jobs_shared(); }
bool row_pool_release_inputs(int64_t wait_us) {
  return plugserve::shared_row_pool()->release_inputs(std::chrono::microseconds(wait_us));
}
#endif

using plugserve::add_layer_norm_impl;
using plugserve::check_add_layer_norm;
using plugserve::check_norm;
using plugserve::check_norm_heads;
using plugserve::check_rotary;
using plugserve::check_rows;
using plugserve::fused_add_rms_norm_impl;
using plugserve::gelu_bf16_impl;
using plugserve::rms_norm_heads_impl;
using plugserve::rms_norm_impl;
using plugserve::rotary_embedding_impl;
using plugserve::silu_and_mul_impl;

// Index of each row's largest value (the first, on ties), as torch.argmax gives it.
// ATen's CPU argmax keeps an index beside every comparison and runs well below the memory
// bandwidth over a batch of logits; here a vectorized max pass, then a search for its
// first occurrence.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0,
              "logits must be float32 [rows, vocab] with a dense last dim");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* base = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = base + r * stride;
      float peak = row[0];
      for (int64_t i = 1; i < n; ++i) peak = std::max(peak, row[i]);
      int64_t found = -1;
      for (int64_t i = 0; i < n; ++i)
        if (row[i] == peak) {
          found = i;
          break;
        }
      // Not found only when the row holds NaN (compiled with -ffast-math, the max pass
      // cannot see it): ATen's answer, the first NaN.
      idx[r] = found >= 0 ? found : at::argmax(logits[r]).item<int64_t>();
    }
  });
  return out;
}

// f(T{}) with T the element type of t: float or c10::BFloat16 (check_rows admits no other).
template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(float{});
  else
    f(c10::BFloat16{});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  check_norm(x, out, "out", weight);
  dispatch(x, [&](auto t) { rms_norm_impl<decltype(t)>(out, x, weight, eps); });
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_norm(x, residual, "residual", weight);
  dispatch(x, [&](auto t) { fused_add_rms_norm_impl<decltype(t)>(x, residual, weight, eps); });
}

void rms_norm_heads(at::Tensor x, const at::Tensor& weight, double eps, int64_t first_head,
                    int64_t num_heads, int64_t head_dim) {
  check_norm_heads(x, weight, first_head, num_heads, head_dim);
  dispatch(x, [&](auto t) {
    rms_norm_heads_impl<decltype(t)>(x, weight, eps, first_head, num_heads, head_dim);
  });
}

void rotary_embedding(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_sin,
                      int64_t num_heads, int64_t head_dim) {
  check_rotary(qk, positions, cos_sin, num_heads, head_dim);
  dispatch(qk, [&](auto t) {
    rotary_embedding_impl<decltype(t)>(qk, positions, cos_sin, num_heads, head_dim);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * columns]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch(out, [&](auto t) { silu_and_mul_impl<decltype(t)>(out, gate_up); });
  return out;
}

void gelu_(at::Tensor x, bool tanh_form) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16");
  gelu_bf16_impl(x, tanh_form);
}

void add_layer_norm_(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight,
                     const at::Tensor& bias, double eps) {
  check_add_layer_norm(x, residual, weight, bias);
  dispatch(x, [&](auto t) { add_layer_norm_impl<decltype(t)>(x, residual, weight, bias, eps); });
}

}  // namespace

TORCH_LIBRARY(plugserve_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rms_norm_heads(Tensor(a!) x, Tensor weight, float eps, int first_head, int num_heads, "
      "int head_dim) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) qk, Tensor positions, Tensor cos_sin, int num_heads, "
      "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_(Tensor(a!) x, bool tanh_form) -> ()");
  m.def(
      "add_layer_norm_(Tensor(a!) x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
      "()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
#ifdef PLUGSERVE_HAS_ROW_POOL
  m.def("row_pool_address() -> int", &row_pool_address);
  m.def("row_pool_set_enabled(bool enabled) -> ()", &row_pool_set_enabled);
  m.def("row_pool_enabled() -> bool", &row_pool_enabled);
  m.def("row_pool_release_inputs(int wait_us) -> bool", &row_pool_release_inputs);
  m.def("row_pool_stall_helper_once(int microseconds) -> ()", &row_pool_stall_helper_once);
  m.def("row_pool_release_helper() -> ()", &row_pool_release_helper);
  m.def("row_pool_items_taken_over() -> int", &row_pool_items_taken_over);
  m.def("row_pool_late_items_dropped() -> int", &row_pool_late_items_dropped);
  m.def("row_pool_jobs_shared() -> int", &row_pool_jobs_shared);
#endif
}

TORCH_LIBRARY_IMPL(plugserve_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm_heads", &rms_norm_heads);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_", &gelu_);
  m.impl("add_layer_norm_", &add_layer_norm_);
  m.impl("argmax_rows", &argmax_rows);
}
