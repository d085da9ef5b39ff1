"""The fused bf16 CPU decoder over W8A8 linears: with stack.linear_method int8 the
fused_cpu_decoder pass runs the whole layer stack as one op, calling each layer's int8
matmul as a C++ call (layer_linear.h) where it would run its own packed weights, and
computes what the same fused layers compute one Python call at a time, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from plugserve.worker import cpu_ops
from plugserve.worker.model_loader import finish_loading
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve_plugins.cpu_bf16 import cpu_features
from plugserve_plugins.cpu_bf16.fused_layer import FusedCpuDecoderLayer
from plugserve_plugins.cpu_bf16.fused_stack import FusedCpuDecoder
from plugserve_plugins.linear_methods import w8a8_plan
from plugserve_plugins.linear_methods.int8_w8a8 import W8A8Linear
from tests.kernel_support import missing_cpu_flags, require_kernel
from tests.model_support import SIZES, PagedRunner, automatic_passes, bf16_model

MISSING = missing_cpu_flags(w8a8_plan.REQUIRED_CPU_FLAGS)
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"the W8A8 kernel needs a CPU with {' and '.join(MISSING)}"
)


def w8a8_llama(hf_model: Any, config: LlamaConfig) -> tuple[Any, Any]:
    model, backend = bf16_model(LlamaForCausalLM, config, num_blocks=16, linear_method="int8")
    model.load_weights(hf_model.state_dict().items())
    routes = finish_loading(model, automatic_passes())
    assert all(route.taken for route in routes), routes
    return model, backend


def test_the_stack_over_w8a8_calls_computes_what_the_fused_layers_do_one_by_one() -> None:
    require_kernel(
        "cpu_decoder.cpp",
        cpu_features.OWN_KERNEL_CPU_FLAGS,
        cpu_features.decoder_unavailable_reason(),
    )
    assert cpu_ops.unavailable_reason() is None
    config = LlamaConfig(**SIZES, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    (stacked, stacked_backend), (layered, layered_backend) = (
        w8a8_llama(hf_model, config),
        w8a8_llama(hf_model, config),
    )
    assert isinstance(stacked.whole_stack, FusedCpuDecoder) and all(stacked.whole_stack.runs_bucket)
    assert all(isinstance(f, FusedCpuDecoderLayer) for f in layered.layer_fns)
    assert all(isinstance(f.o_proj, W8A8Linear) for f in layered.layer_fns)
    layered.install_stack(None)  # the same fused layers, each called from Python

    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (20, 3, 40)]
    steps = [
        [(str(i), p) for i, p in enumerate(prompts)],  # prefill
        [(str(i), [7 + i]) for i in range(3)],  # decode, every row
        [("1", [9])],  # decode, one row
    ]
    a = PagedRunner(stacked, stacked_backend, 16)
    b = PagedRunner(layered, layered_backend, 16)
    for rows in steps:
        assert torch.equal(a.step(rows), b.step(rows))
