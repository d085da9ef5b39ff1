// One layer's attention as a plain C++ call, for a fused CPU decoder that runs a whole
// step's layer stack in one op instead of returning to Python around every attention call.
//
// The decoder (core, cpu_decoder.cpp) and the attention kernel (a plugin) are separate
// libraries that never link to each other. A backend that offers this call hands out two
// integers (AttentionBackend.cpu_layer_call): the address of a function of this type and
// the context it takes, its state for the current step, valid until its next prepare().
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace plugserve {

// q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (views into the fused
// QKV projection: each token's heads contiguous, any row stride). Writes k and v into the
// cache at the step's slots, attends causally, returns [tokens, heads, head_dim].
using LayerAttentionFn = at::Tensor (*)(const void* context, int64_t layer, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v);

}  // namespace plugserve
