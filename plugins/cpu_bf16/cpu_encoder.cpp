// Everything a bf16 post-LayerNorm encoder layer (BERT's) computes after its attention, and
// the next layer's qkv, as one op:
//
//   h = LayerNorm(o_proj(attention output) + x)
//   x' = LayerNorm(down(GELU(up(h))) + h)
//   then, unless this was the last layer: qkv = the next layer's qkv_proj(x')
//
// A sentence embedder serves one short prompt at a time as readily as many: over a short
// prompt a layer's matmuls are short too, and calling each op from Python (with its
// module, its checks, the gap in which OpenMP's threads fall asleep) costs a share of
// them (docs/benchmarks-history.md, "The fused encoder and the embeddings benchmark in
// turns"). Seven calls and their frames per layer become one. The arithmetic is
// cpu_gemm.h's and cpu_ops.h's, in the same order, so the results equal the per-op path's
// (fused_encoder.py; tested).
//
// The weights of every layer sit in one EncoderStack, built once at load; encode_stretch
// runs one layer's stretch of it, with the attention backend's forward called from Python in
// between (the encoder's attention is the backend's, bidirectional).
//
// Registered as torch.ops.plugserve_encoder.encode_stretch, with
// torch.classes.plugserve_encoder.EncoderStack; built and loaded by cpu_features.py for
// fused_encoder.py. Only where cpu_gemm.h builds (AVX512_BF16), since it takes the weights in
// that kernel's packed layout.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "cpu_gemm.h"
#include "cpu_ops.h"

#ifdef PLUGSERVE_HAS_BF16_GEMM

namespace {

using BF16 = c10::BFloat16;

struct EncoderStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor o_proj;
    c10::optional<at::Tensor> o_bias;
    at::Tensor attention_norm_weight, attention_norm_bias;
    at::Tensor up_proj;
    c10::optional<at::Tensor> up_bias;
    at::Tensor down_proj;
    c10::optional<at::Tensor> down_bias;
    at::Tensor output_norm_weight, output_norm_bias;
    double eps;
    bool gelu_tanh;
    c10::optional<at::Tensor> next_qkv_proj, next_qkv_bias;
    int64_t qkv_features;
    int64_t intermediate;  // up's output features (down's input), from its packed weight
  };

  void add_layer(at::Tensor o_proj, c10::optional<at::Tensor> o_bias,
                 at::Tensor attention_norm_weight, at::Tensor attention_norm_bias,
                 at::Tensor up_proj, c10::optional<at::Tensor> up_bias, at::Tensor down_proj,
                 c10::optional<at::Tensor> down_bias, at::Tensor output_norm_weight,
                 at::Tensor output_norm_bias, double eps, bool gelu_tanh,
                 c10::optional<at::Tensor> next_qkv_proj,
                 c10::optional<at::Tensor> next_qkv_bias, int64_t qkv_features) {
    TORCH_CHECK(layers.empty() || layers.back().next_qkv_proj.has_value(),
                "the last layer added has no next qkv_proj: the stack is complete");
    TORCH_CHECK(down_proj.dim() == 4, "down_proj must be cpu_gemm's packed weight");
    const int64_t intermediate = 2 * down_proj.size(1);
    layers.push_back({std::move(o_proj), std::move(o_bias), std::move(attention_norm_weight),
                      std::move(attention_norm_bias), std::move(up_proj), std::move(up_bias),
                      std::move(down_proj), std::move(down_bias), std::move(output_norm_weight),
                      std::move(output_norm_bias), eps, gelu_tanh, std::move(next_qkv_proj),
                      std::move(next_qkv_bias), qkv_features, intermediate});
  }

  std::vector<Layer> layers;
};

at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, int64_t mode) {
  return plugserve::linear_bf16(x, packed, out_features, bias, c10::nullopt, c10::nullopt,
                                plugserve::mode_for(packed, mode));
}

// Layer `index`'s stretch: its attention output [T, hidden] and input x [T, hidden] → the
// layer's output and, but after the last layer, the next layer's qkv [T, 3 * hidden].
std::vector<at::Tensor> encode_stretch(const c10::intrusive_ptr<EncoderStack>& stack,
                                       int64_t index, const at::Tensor& attention_out,
                                       const at::Tensor& x, int64_t mode) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(stack->layers.size()), "layer ",
              index, " is not in the stack");
  plugserve::check_step_mode(mode);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(0) == attention_out.size(0),
              "x must be contiguous bfloat16 [tokens, hidden]");
  const EncoderStack::Layer& layer = stack->layers[index];
  const int64_t hidden = x.size(1);

  at::Tensor h = matmul(attention_out, layer.o_proj, hidden, layer.o_bias, mode);
  plugserve::check_add_layer_norm(h, x, layer.attention_norm_weight, layer.attention_norm_bias);
  plugserve::add_layer_norm_impl<BF16>(h, x, layer.attention_norm_weight,
                                       layer.attention_norm_bias, layer.eps);
  at::Tensor up = matmul(h, layer.up_proj, layer.intermediate, layer.up_bias, mode);
  plugserve::gelu_bf16_impl(up, layer.gelu_tanh);
  at::Tensor out = matmul(up, layer.down_proj, hidden, layer.down_bias, mode);
  plugserve::check_add_layer_norm(out, h, layer.output_norm_weight, layer.output_norm_bias);
  plugserve::add_layer_norm_impl<BF16>(out, h, layer.output_norm_weight, layer.output_norm_bias,
                                       layer.eps);
  if (!layer.next_qkv_proj.has_value()) return {out};
  return {out, matmul(out, *layer.next_qkv_proj, layer.qkv_features, layer.next_qkv_bias, mode)};
}

}  // namespace

TORCH_LIBRARY(plugserve_encoder, m) {
  m.class_<EncoderStack>("EncoderStack")
      .def(torch::init<>())
      .def("add_layer", &EncoderStack::add_layer);
  m.def(
      "encode_stretch(__torch__.torch.classes.plugserve_encoder.EncoderStack stack, int index, "
      "Tensor attention_out, Tensor x, int mode) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(plugserve_encoder, CPU, m) { m.impl("encode_stretch", &encode_stretch); }

#endif
