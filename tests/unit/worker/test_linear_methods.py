"""The linear-method seam: which method each linear layer runs, how a method creates,
loads and processes its layers' weights, and what a layer calls on forward."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from correctness.tiny_checkpoints import tiny
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from plugserve import hookimpl
from plugserve.interfaces.model import LinearLayer, LinearMethod, TiedLmHead
from plugserve.plugins import PluginRegistry
from plugserve.worker.layers.linear import Linear, RowParallelLinear
from plugserve.worker.layers.plain_linear import PlainLinearMethod
from plugserve.worker.linear_methods import (
    LinearMethodChooser,
    give_linear_methods,
    linear_methods_of,
    process_linear_weights,
)
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve.worker.parallel import ParallelContext
from plugserve_plugins.cpu_bf16.linear_method import PackedCpuBf16
from plugserve_plugins.linear_methods.cpu_fp32 import CpuFp32LinearMethod
from plugserve_plugins.linear_methods.int8_w8a8 import Int8W8A8

CPU = torch.device("cpu")


class Recording(PlainLinearMethod):
    """The plain method, recording what the loader asks of it."""

    def __init__(self) -> None:
        self.created: list[LinearLayer] = []
        self.loaded: list[tuple[LinearLayer, torch.Tensor]] = []
        self.processed: list[tuple[list[LinearLayer], nn.Module, TiedLmHead | None]] = []

    def create_weights(self, layer: LinearLayer) -> None:
        self.created.append(layer)
        super().create_weights(layer)

    def load_weight(
        self, layer: LinearLayer, param: nn.Parameter, destination: torch.Tensor, loaded: Any
    ) -> None:
        self.loaded.append((layer, loaded))
        super().load_weight(layer, param, destination, loaded)

    def process_weights_after_loading(
        self, layers: Sequence[LinearLayer], *, model: nn.Module, tied_head: TiedLmHead | None
    ) -> None:
        self.processed.append((list(layers), model, tied_head))


def registry_with(name: str, cls: type) -> PluginRegistry:
    """A registry holding the bundled plugins and `cls`, registered as a third party's."""
    registry = PluginRegistry()
    plugin = types.SimpleNamespace(
        register_linear_methods=hookimpl(lambda register: register(name, cls))
    )
    registry.register(plugin, name=name, distribution=f"acme-{name}")
    return registry


def tied_llama() -> LlamaForCausalLM:
    """A tiny Llama with tied embeddings, built as the loader builds it (no attention runs)."""
    return LlamaForCausalLM(
        hf_config=LlamaConfig(**tiny(vocab_size=256), tie_word_embeddings=True), attention=None
    )


def test_a_layer_starts_with_the_plain_method_and_computes_f_linear() -> None:
    layer = Linear(8, 4, bias=True)
    weight, bias, x = torch.randn(4, 8), torch.randn(4), torch.randn(3, 8)
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)

    assert isinstance(layer.method, PlainLinearMethod)
    assert isinstance(layer.method, LinearMethod)
    assert torch.equal(layer(x), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        (torch.bfloat16, CPU, PackedCpuBf16),
        (torch.float32, CPU, CpuFp32LinearMethod),
        (torch.bfloat16, torch.device("cuda"), PlainLinearMethod),
        (torch.float32, torch.device("cuda"), PlainLinearMethod),
    ],
    ids=["bf16-cpu", "fp32-cpu", "bf16-cuda", "fp32-cuda"],
)
def test_left_unset_the_dtype_and_device_choose_the_method(
    dtype: torch.dtype, device: torch.device, expected: type
) -> None:
    chooser = LinearMethodChooser(dtype=dtype, device=device)
    assert type(chooser.method_for(Linear(8, 4, bias=False))) is expected


def test_a_named_method_runs_every_layer_whatever_the_dtype() -> None:
    chooser = LinearMethodChooser(dtype=torch.float32, device=CPU, selected="int8")
    assert isinstance(chooser.method_for(Linear(8, 4, bias=False)), Int8W8A8)


def test_a_methods_options_come_from_its_block() -> None:
    chooser = LinearMethodChooser(
        dtype=torch.bfloat16, device=CPU, plugin_options={"cpu_bf16": {"coded_weights": False}}
    )
    method = chooser.method_for(Linear(8, 4, bias=False))
    assert isinstance(method, PackedCpuBf16) and not method.options.coded_weights


def test_one_method_object_creates_loads_and_processes_every_layer_once_in_module_order() -> None:
    registry = registry_with("recording", Recording)
    chooser = LinearMethodChooser(
        dtype=torch.float32, device=CPU, selected="recording", registry=registry
    )
    model = tied_llama()
    give_linear_methods(model, chooser)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    method = linears[0].method
    assert isinstance(method, Recording) and all(m.method is method for m in linears)
    assert method.created == linears

    hf_model = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    model.load_weights(hf_model.state_dict().items())
    assert {id(layer) for layer, _ in method.loaded} == {id(m) for m in linears}

    assert process_linear_weights(model) == [method] == linear_methods_of(model)
    [(layers, processed_model, tied_head)] = method.processed
    assert layers == linears and processed_model is model
    assert tied_head is model.model.embed_tokens


def test_a_method_may_create_parameters_of_its_own_dtype() -> None:
    class HalfStored(PlainLinearMethod):
        def create_weights(self, layer: LinearLayer) -> None:
            layer.add_parameter("weight", (layer.out_features, layer.in_features), torch.half)

        def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, layer.weight.float())  # type: ignore[attr-defined]

    layer = Linear(8, 4, bias=False)
    layer.use_method(HalfStored())
    weight, x = torch.randn(4, 8), torch.randn(3, 8)
    layer.weight_loader(layer.weight, weight)
    assert layer.weight.dtype == torch.half and layer.bias is None
    assert torch.equal(layer(x), F.linear(x, weight.half().float()))


def test_what_a_method_installs_runs_the_layer_and_the_loaded_weight_is_freed() -> None:
    layer = Linear(8, 4, bias=True)
    layer.install(lambda x, out_dtype=None: torch.zeros(x.shape[0], 4))
    assert layer.weight.numel() == 0 and layer.bias is not None and layer.bias.numel() == 4
    assert layer.kernel() is layer.packed
    assert torch.equal(layer(torch.randn(3, 8)), torch.zeros(3, 4))


def test_a_row_parallel_shard_leaves_its_bias_to_after_the_all_reduce() -> None:
    whole = RowParallelLinear(8, 4, bias=True)
    shard = RowParallelLinear(8, 4, bias=True, parallel=ParallelContext(rank=0, world_size=2))
    assert whole.matmul_bias is whole.bias
    assert shard.matmul_bias is None and shard.bias is not None
    assert shard.kernel() is shard


@pytest.mark.parametrize(
    "dtype,selected,named",
    [(torch.float32, None, "cpu_fp32"), (torch.bfloat16, "int8", "int8")],
    ids=["fp32-cpu_fp32", "int8"],
)
def test_batch_invariance_refuses_a_method_that_cannot_keep_one_order(
    dtype: torch.dtype, selected: str | None, named: str
) -> None:
    """engine.batch_invariant: the chooser asks each method it builds to keep one reduction
    order (capabilities.SupportsBatchInvariance); one without it is refused by name."""
    chooser = LinearMethodChooser(
        dtype=dtype, device=torch.device("cpu"), selected=selected, batch_invariant=True
    )
    with pytest.raises(ValueError, match=rf"engine\.batch_invariant: linear method '{named}'"):
        chooser.method_for(nn.Linear(4, 4))
