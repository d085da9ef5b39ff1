// Everything a bf16 Llama decoder computes between two attention calls, as one op:
//
//   h = o_proj(attention output); residual += h; h = rms_norm(residual) * post-attention norm
//   m = down(silu(gate(h)) * up(h)); residual += m; m = rms_norm(residual) * next norm
//   then, unless this was the last layer: qkv = the next layer's qkv_proj(m), RoPE applied
//
// At batch 1 a decode step is ~270 short ops, and calling each from Python costs more than
// many of them take: eight calls and a frame per layer become one. The arithmetic is
// cpu_gemm.h's and cpu_ops.h's, in the same order, so results equal the per-op path's.
//
// Registered as torch.ops.plugserve_decoder.between_attentions; built and loaded by
// models/llama_cpu.py. Only where cpu_gemm.h builds (AVX512_BF16), since it takes the
// weights in that kernel's packed layout.
#include <torch/library.h>

#include "cpu_gemm.h"
#include "cpu_ops.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

namespace {

using BF16 = c10::BFloat16;

at::Tensor between_attentions(const at::Tensor& attention_out, at::Tensor residual,
                              const at::Tensor& positions, const at::Tensor& o_proj,
                              const c10::optional<at::Tensor>& o_bias,
                              const at::Tensor& post_attention_norm,
                              const at::Tensor& gate_up_proj,
                              const c10::optional<at::Tensor>& gate_up_bias,
                              const at::Tensor& down_proj,
                              const c10::optional<at::Tensor>& down_bias,
                              const at::Tensor& next_norm, double eps,
                              const c10::optional<at::Tensor>& next_qkv_proj,
                              const c10::optional<at::Tensor>& next_qkv_bias,
                              int64_t qkv_features, const at::Tensor& cos_sin,
                              int64_t num_qk_heads, int64_t head_dim) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
                  residual.scalar_type() == at::kBFloat16 &&
                  residual.size(0) == attention_out.size(0),
              "residual must be contiguous bfloat16 [tokens, hidden]");
  const int64_t hidden = residual.size(1);
  const int64_t intermediate = 2 * down_proj.size(1);  // down's input, in k-pairs
  plugserve::check_norm_weight(post_attention_norm, residual);
  plugserve::check_norm_weight(next_norm, residual);

  at::Tensor h = plugserve::linear_bf16(attention_out, o_proj, hidden, o_bias);
  plugserve::fused_add_rms_norm_impl<BF16>(h, residual, post_attention_norm, eps);
  at::Tensor gate_up = plugserve::linear_bf16(h, gate_up_proj, 2 * intermediate, gate_up_bias);
  at::Tensor activated = at::empty({gate_up.size(0), intermediate}, gate_up.options());
  plugserve::silu_and_mul_impl<BF16>(activated, gate_up);
  at::Tensor m = plugserve::linear_bf16(activated, down_proj, hidden, down_bias);
  plugserve::fused_add_rms_norm_impl<BF16>(m, residual, next_norm, eps);
  if (!next_qkv_proj.has_value()) return m;  // the last layer: m is the model's output

  at::Tensor qkv = plugserve::linear_bf16(m, *next_qkv_proj, qkv_features, next_qkv_bias);
  plugserve::check_rotary(qkv, positions, cos_sin, num_qk_heads, head_dim);
  plugserve::rotary_embedding_impl<BF16>(qkv, positions, cos_sin, num_qk_heads, head_dim);
  return qkv;
}

}  // namespace

TORCH_LIBRARY(plugserve_decoder, m) {
  m.def(
      "between_attentions(Tensor attention_out, Tensor(a!) residual, Tensor positions, "
      "Tensor o_proj, Tensor? o_bias, Tensor post_attention_norm, Tensor gate_up_proj, "
      "Tensor? gate_up_bias, Tensor down_proj, Tensor? down_bias, Tensor next_norm, "
      "float eps, Tensor? next_qkv_proj, Tensor? next_qkv_bias, int qkv_features, "
      "Tensor cos_sin, int num_qk_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(plugserve_decoder, CPU, m) {
  m.impl("between_attentions", &between_attentions);
}

#endif
