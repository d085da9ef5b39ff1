"""The cpu_fp32 linear method: fp32 weights reordered once for oneDNN's matmul, or kept
for F.linear, whichever timed faster on the model's own matmuls (both pinnable); every
linear of a model computes what F.linear does over the loaded weights, to fp32 rounding
(another summation order), and a tied LM head keeps F.linear over the embedding's matrix
(no second copy of the vocabulary); other dtypes are refused by name."""

from __future__ import annotations

import re

import pydantic
import pytest
import torch
import torch.nn.functional as F
from correctness.tiny_checkpoints import tiny
from transformers import AutoModelForCausalLM, LlamaConfig

from plugserve.worker.layers.linear import Linear
from plugserve.worker.linear_methods import (
    LinearMethodChooser,
    give_linear_methods,
    process_linear_weights,
)
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve_plugins.linear_methods import cpu_fp32
from plugserve_plugins.linear_methods.cpu_fp32 import CpuFp32LinearMethod, OneDnnLinear

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not cpu_fp32.onednn_available(), reason="this torch is built without oneDNN"
)


def loaded_tied_llama(kernel: str) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    """A tiny Llama with tied embeddings under cpu_fp32 pinned to `kernel`, its weights
    loaded from a random transformers model; also those weights by name."""
    config = LlamaConfig(**tiny(vocab_size=256), tie_word_embeddings=True)
    model = LlamaForCausalLM(hf_config=config, attention=None)
    chooser = LinearMethodChooser(
        dtype=torch.float32, device=CPU, plugin_options={"cpu_fp32": {"kernel": kernel}}
    )
    give_linear_methods(model, chooser)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    model.load_weights(hf_model.state_dict().items())
    process_linear_weights(model)
    return model, weights


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=needs_onednn), "aten"])
def test_every_linear_and_the_tied_head_compute_f_linear_without_copying_the_head(
    kernel: str,
) -> None:
    model, weights = loaded_tied_llama(kernel)
    [method] = {id(m.method): m.method for m in model.modules() if isinstance(m, Linear)}.values()
    assert isinstance(method, CpuFp32LinearMethod) and method.kernel == kernel
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    gate_up = model.model.layers[0].mlp.gate_up_proj
    if kernel == "onednn":  # the loaded weight is freed: the reordered copy is the only one
        assert isinstance(gate_up.packed, OneDnnLinear) and gate_up.weight.numel() == 0
    expected = F.linear(
        x,
        torch.cat(
            [
                weights["model.layers.0.mlp.gate_proj.weight"],
                weights["model.layers.0.mlp.up_proj.weight"],
            ]
        ),
    )
    torch.testing.assert_close(gate_up(x), expected, rtol=1e-5, atol=1e-5)
    head = model.model.embed_tokens  # tied: F.linear over the embedding's own matrix
    assert head.packed_head is None
    torch.testing.assert_close(
        head.logits(x), F.linear(x, weights["model.embed_tokens.weight"]), rtol=1e-5, atol=1e-5
    )


@needs_onednn
def test_a_bias_is_added_and_out_dtype_honoured() -> None:
    weight, bias = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(7, 16)
    linear = OneDnnLinear(weight, bias)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias))
    assert linear(x, torch.bfloat16).dtype == torch.bfloat16


def test_other_dtypes_are_refused_by_name() -> None:
    layer = Linear(16, 8, bias=False)
    method = CpuFp32LinearMethod()
    layer.use_method(method)
    layer.weight.data = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"runs float32 weights on a CPU, not torch\.bfloat16"):
        method.process_weights_after_loading([layer], model=layer, tied_head=None)


@needs_onednn
def test_the_timed_choice_is_the_faster_of_the_two_timings_it_logs() -> None:
    """Under kernel auto the method takes what this returns: whichever way the timing goes
    on this machine, the answer is the one its logged timings give."""
    weights = [torch.randn(1152, 384), torch.randn(384, 1536), torch.randn(1152, 384)]
    faster, line = cpu_fp32.onednn_is_faster(weights)
    assert "over 2 weight shapes" in line
    found = re.search(r"oneDNN ([\d.]+) ms, ATen ([\d.]+) ms .*; using (oneDNN|ATen)", line)
    assert found, line
    onednn_ms, aten_ms, using = float(found[1]), float(found[2]), found[3]
    assert faster is (using == "oneDNN")
    assert faster is (onednn_ms < aten_ms)


@needs_onednn
def test_auto_keeps_the_kernel_that_timed_faster(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger=cpu_fp32.__name__):
        model, _ = loaded_tied_llama("auto")
    [line] = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
    method = model.model.layers[0].mlp.gate_up_proj.method
    assert method.kernel == ("onednn" if line.endswith("using oneDNN") else "aten")


@pytest.mark.parametrize("setting", ["onednn", "aten", "auto"])
def test_the_environment_sets_the_kernel_where_the_options_do_not(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_fp32.KERNEL_ENV, setting)
    assert CpuFp32LinearMethod.Options().kernel == setting
    assert CpuFp32LinearMethod.Options(kernel="aten").kernel == "aten"
    monkeypatch.delenv(cpu_fp32.KERNEL_ENV)
    assert CpuFp32LinearMethod.Options().kernel == "auto"


def test_a_kernel_the_method_has_not_got_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_fp32.KERNEL_ENV, "mkl")
    with pytest.raises(pydantic.ValidationError, match="kernel"):
        CpuFp32LinearMethod.Options()
