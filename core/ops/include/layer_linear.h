// One linear layer's matmul as a plain C++ call, for a fused CPU decoder that runs a whole
// step's layer stack in one op: a linear method whose kernel is C++ (a quantized one) lets
// the decoder call it between the decoder's own ops, as it calls the attention kernel
// (layer_attention.h), instead of leaving the stack to Python layer by layer.
//
// The decoder and the linear method are separate libraries that never link to each other.
// A layer's installed matmul that offers this call hands out two integers
// (capabilities.SupportsCpuLinearCall): the address of a function of this type and the
// context it takes, valid for as long as that matmul object lives.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace plugserve {

// x [tokens, in_features] (dense last dim, the model's dtype) → x @ W.T + bias
// [tokens, out_features] in x's dtype.
using LinearCallFn = at::Tensor (*)(const void* context, const at::Tensor& x);

}  // namespace plugserve
