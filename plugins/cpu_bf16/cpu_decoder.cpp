// Everything a bf16 pre-norm decoder computes between two attention calls, as one op:
//
//   h = o_proj(attention output); residual += h; h = rms_norm(residual) * post-attention norm
//   m = down(silu(gate(h)) * up(h)); residual += m; m = rms_norm(residual) * next norm
//   then, unless this was the last layer: qkv = the next layer's qkv_proj(m), its q/k norm
//   over each q and k head where it has one (Qwen3), RoPE where it rotates (not in
//   SmolLM3's NoPE layers; over the first rotary dimensions with a partial rotary factor)
//
// At batch 1 a decode step is a few hundred short ops, and calling each from Python costs
// more than many of them take: eight calls and a frame per layer become one. The
// arithmetic is cpu_gemm.h's and cpu_ops.h's, in the same order, so results equal the
// per-op path's (fused_layer.py).
//
// The weights of every layer sit in one LayerStack, built once at load. decode_stretch runs
// one stretch of it (the fallback, with the attention backend's forward called from Python
// in between); where the backend offers its kernel as a C++ call (layer_attention.h),
// decode_layers runs the whole stack in one op: a batch-1 step then makes one call from
// Python instead of sixty, and no Python runs while the weights stream.
//
// A layer's linears may instead be another library's C++ calls (layer_linear.h: a quantized
// linear method's kernels), called in the same places; the rest of the stretch is the same.
//
// Registered as torch.ops.plugserve_decoder.decode_stretch and decode_layers, with
// torch.classes.plugserve_decoder.LayerStack; built and loaded by cpu_features.py for
// fused_stack.py. Only where cpu_gemm.h builds (AVX512_BF16), since it takes the weights
// in that kernel's packed layout.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_ops.h"
#include "layer_attention.h"
#include "layer_linear.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

namespace {

using BF16 = c10::BFloat16;

// Every layer's weights, built once at load; the *_coded ones are the matmuls' exponent-coded
// copies (cpu_gemm.h) where the model has them, which a one-row step reads instead. The
// next_* fields are what the next layer does to its qkv before attention: its q/k norm
// weights (none without one) and whether it rotates. A layer whose linears another library
// computes (a quantized linear method's, layer_linear.h) holds their calls instead of
// packed weights (set_linear_calls), in the order o, gate_up, down, next qkv.
struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    int64_t attention_layer;
    at::Tensor o_proj;
    c10::optional<at::Tensor> o_bias;
    at::Tensor post_attention_norm, gate_up_proj;
    c10::optional<at::Tensor> gate_up_bias;
    at::Tensor down_proj;
    c10::optional<at::Tensor> down_bias;
    at::Tensor next_norm;
    double eps;
    c10::optional<at::Tensor> next_qkv_proj, next_qkv_bias;
    int64_t qkv_features;
    c10::optional<at::Tensor> o_coded, gate_up_coded, down_coded, next_qkv_coded;
    c10::optional<at::Tensor> next_q_norm, next_k_norm;
    double next_qk_norm_eps;
    bool next_rotates;
    int64_t intermediate;  // the MLP's width (down's input features), from its packed weight
    std::array<int64_t, 4> call_fn{}, call_context{};  // 0: the packed weight
  };

  LayerStack(at::Tensor cos_sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim)
      : cos_sin(std::move(cos_sin)),
        num_heads(num_heads),
        num_kv_heads(num_kv_heads),
        head_dim(head_dim) {}

  void add_layer(int64_t attention_layer, at::Tensor o_proj, c10::optional<at::Tensor> o_bias,
                 at::Tensor post_attention_norm, at::Tensor gate_up_proj,
                 c10::optional<at::Tensor> gate_up_bias, at::Tensor down_proj,
                 c10::optional<at::Tensor> down_bias, at::Tensor next_norm, double eps,
                 c10::optional<at::Tensor> next_qkv_proj,
                 c10::optional<at::Tensor> next_qkv_bias, int64_t qkv_features,
                 c10::optional<at::Tensor> o_coded, c10::optional<at::Tensor> gate_up_coded,
                 c10::optional<at::Tensor> down_coded,
                 c10::optional<at::Tensor> next_qkv_coded,
                 c10::optional<at::Tensor> next_q_norm, c10::optional<at::Tensor> next_k_norm,
                 double next_qk_norm_eps, bool next_rotates) {
    TORCH_CHECK(layers.empty() || layers.back().next_qkv_proj.has_value(),
                "the last layer added has no next qkv_proj: the stack is complete");
    TORCH_CHECK(next_q_norm.has_value() == next_k_norm.has_value(),
                "a q/k norm needs both the q and the k weights");
    // Read before the list below moves down_proj; 0 for a layer of linear calls.
    const int64_t intermediate = down_proj.dim() == 4 ? 2 * down_proj.size(1) : 0;
    layers.push_back({attention_layer, std::move(o_proj), std::move(o_bias),
                      std::move(post_attention_norm), std::move(gate_up_proj),
                      std::move(gate_up_bias), std::move(down_proj), std::move(down_bias),
                      std::move(next_norm), eps, std::move(next_qkv_proj),
                      std::move(next_qkv_bias), qkv_features, std::move(o_coded),
                      std::move(gate_up_coded), std::move(down_coded),
                      std::move(next_qkv_coded), std::move(next_q_norm),
                      std::move(next_k_norm), next_qk_norm_eps, next_rotates, intermediate});
  }

  // Layer `index`'s linears as LinearCallFn calls (fns[i] with contexts[i]) instead of its
  // packed weights (added as empty tensors): o, gate_up, down, next qkv (the last layer's
  // fourth is 0: it has none).
  void set_linear_calls(int64_t index, std::vector<int64_t> fns, std::vector<int64_t> contexts) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers.size()), "layer ", index,
                " is not in the stack");
    TORCH_CHECK(fns.size() == 4 && contexts.size() == 4, "four calls: o, gate_up, down, qkv");
    Layer& layer = layers[index];
    for (int i = 0; i < 4; ++i) {
      const bool needed = i < 3 || layer.next_qkv_proj.has_value();
      TORCH_CHECK(!needed || (fns[i] != 0 && contexts[i] != 0), "linear call ", i, " missing");
      layer.call_fn[i] = fns[i];
      layer.call_context[i] = contexts[i];
    }
  }

  std::vector<Layer> layers;
  at::Tensor cos_sin;
  int64_t num_heads, num_kv_heads, head_dim;
};

// One of a layer's linears (slot: o, gate_up, down, next qkv): its call where another
// library computes it, else cpu_gemm's packed weight.
at::Tensor matmul(const LayerStack::Layer& layer, int slot, const at::Tensor& x,
                  const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& coded,
                  int64_t mode) {
  if (layer.call_fn[slot] != 0) {
    const auto call = reinterpret_cast<plugserve::LinearCallFn>(layer.call_fn[slot]);
    return call(reinterpret_cast<const void*>(layer.call_context[slot]), x);
  }
  return plugserve::linear_bf16(x, packed, out_features, bias, c10::nullopt, coded,
                                plugserve::mode_for(packed, mode));
}

// Layer `layer`'s stretch: its attention output [T, q heads * D] → the next layer's rotated
// qkv, or after the last layer the final-normed hidden states.
at::Tensor stretch(const LayerStack& stack, const LayerStack::Layer& layer,
                   const at::Tensor& attention_out, at::Tensor residual,
                   const at::Tensor& positions, int64_t mode) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
                  residual.scalar_type() == at::kBFloat16 &&
                  residual.size(0) == attention_out.size(0),
              "residual must be contiguous bfloat16 [tokens, hidden]");
  const int64_t hidden = residual.size(1);
  const double eps = layer.eps;
  plugserve::check_norm_weight(layer.post_attention_norm, residual);
  plugserve::check_norm_weight(layer.next_norm, residual);

  at::Tensor h = matmul(layer, 0, attention_out, layer.o_proj, hidden, layer.o_bias,
                        layer.o_coded, mode);
  plugserve::fused_add_rms_norm_impl<BF16>(h, residual, layer.post_attention_norm, eps);
  at::Tensor gate_up = matmul(layer, 1, h, layer.gate_up_proj, 2 * layer.intermediate,
                              layer.gate_up_bias, layer.gate_up_coded, mode);
  at::Tensor activated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  plugserve::silu_and_mul_impl<BF16>(activated, gate_up);
  at::Tensor m = matmul(layer, 2, activated, layer.down_proj, hidden, layer.down_bias,
                        layer.down_coded, mode);
  plugserve::fused_add_rms_norm_impl<BF16>(m, residual, layer.next_norm, eps);
  if (!layer.next_qkv_proj.has_value()) return m;  // the last layer: m is the model's output

  at::Tensor qkv = matmul(layer, 3, m, *layer.next_qkv_proj, layer.qkv_features,
                          layer.next_qkv_bias, layer.next_qkv_coded, mode);
  const int64_t heads = stack.num_heads, kv_heads = stack.num_kv_heads, d = stack.head_dim;
  if (layer.next_q_norm.has_value()) {
    plugserve::check_norm_heads(qkv, *layer.next_q_norm, 0, heads, d);
    plugserve::check_norm_heads(qkv, *layer.next_k_norm, heads, kv_heads, d);
    plugserve::rms_norm_heads_impl<BF16>(qkv, *layer.next_q_norm, layer.next_qk_norm_eps, 0,
                                         heads, d);
    plugserve::rms_norm_heads_impl<BF16>(qkv, *layer.next_k_norm, layer.next_qk_norm_eps,
                                         heads, kv_heads, d);
  }
  if (layer.next_rotates) {
    plugserve::check_rotary(qkv, positions, stack.cos_sin, heads + kv_heads, d);
    plugserve::rotary_embedding_impl<BF16>(qkv, positions, stack.cos_sin, heads + kv_heads, d);
  }
  return qkv;
}

at::Tensor decode_stretch(const c10::intrusive_ptr<LayerStack>& stack, int64_t index,
                          const at::Tensor& attention_out, at::Tensor residual,
                          const at::Tensor& positions, int64_t mode) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(stack->layers.size()), "layer ",
              index, " is not in the stack");
  plugserve::check_step_mode(mode);
  return stretch(*stack, stack->layers[index], attention_out, residual, positions, mode);
}

// The first layer's rotated qkv [T, (q + k + v heads) * D] → the final-normed hidden states.
at::Tensor decode_layers(const c10::intrusive_ptr<LayerStack>& stack, at::Tensor qkv,
                         at::Tensor residual, const at::Tensor& positions,
                         int64_t attention_fn, int64_t attention_context, int64_t mode) {
  TORCH_CHECK(attention_fn != 0, "no attention call");
  plugserve::check_step_mode(mode);
  TORCH_CHECK(!stack->layers.empty() && !stack->layers.back().next_qkv_proj.has_value(),
              "the stack must end with a layer that has no next qkv_proj");
  const auto attend = reinterpret_cast<plugserve::LayerAttentionFn>(attention_fn);
  const auto* context = reinterpret_cast<const void*>(attention_context);
  const int64_t heads = stack->num_heads, kv_heads = stack->num_kv_heads, d = stack->head_dim;
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim]");
  for (const LayerStack::Layer& layer : stack->layers) {
    const at::Tensor by_head = qkv.view({tokens, heads + 2 * kv_heads, d});
    const at::Tensor attention_out =
        attend(context, layer.attention_layer, by_head.narrow(1, 0, heads),
               by_head.narrow(1, heads, kv_heads), by_head.narrow(1, heads + kv_heads, kv_heads))
            .view({tokens, heads * d});
    qkv = stretch(*stack, layer, attention_out, residual, positions, mode);
  }
  return qkv;
}

}  // namespace

TORCH_LIBRARY(plugserve_decoder, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t>())
      .def("add_layer", &LayerStack::add_layer)
      .def("set_linear_calls", &LayerStack::set_linear_calls);
  m.def(
      "decode_stretch(__torch__.torch.classes.plugserve_decoder.LayerStack stack, int index, "
      "Tensor attention_out, Tensor(a!) residual, Tensor positions, int mode) -> Tensor");
  m.def(
      "decode_layers(__torch__.torch.classes.plugserve_decoder.LayerStack stack, Tensor qkv, "
      "Tensor(a!) residual, Tensor positions, int attention_fn, int attention_context, "
      "int mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(plugserve_decoder, CPU, m) {
  m.impl("decode_stretch", &decode_stretch);
  m.impl("decode_layers", &decode_layers);
}

#endif
