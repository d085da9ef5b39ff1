"""The cpu_fp32 linear method: fp32 weights reordered once for oneDNN's matmul, packed once
for the FMA register tiles, or kept for F.linear, whichever timed fastest on the model's
own matmuls (each pinnable); every linear of a model computes what F.linear does over the
loaded weights, to fp32 rounding (another summation order), and a tied LM head keeps
F.linear over the embedding's matrix (no second copy of the vocabulary); other dtypes are
refused by name."""

from __future__ import annotations

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
from plugserve_plugins.linear_methods.cpu_fp32 import (
    CpuFp32LinearMethod,
    FmaLinear,
    OneDnnLinear,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not cpu_fp32.onednn_available(), reason="this torch is built without oneDNN"
)
needs_fma_tiles = pytest.mark.skipif(
    cpu_fp32.fma_unavailable_reason() is not None,
    reason=f"the FMA tiles cannot run here: {cpu_fp32.fma_unavailable_reason()}",
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


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param("onednn", marks=needs_onednn),
        pytest.param("fma", marks=needs_fma_tiles),
        "aten",
    ],
)
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


@pytest.mark.parametrize(
    "compute",
    [
        pytest.param(OneDnnLinear, marks=needs_onednn),
        pytest.param(FmaLinear, marks=needs_fma_tiles),
    ],
)
def test_a_bias_is_added_and_out_dtype_honoured(compute: type) -> None:
    weight, bias = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(7, 16)
    linear = compute(weight, bias)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias))
    assert linear(x, torch.bfloat16).dtype == torch.bfloat16


@needs_fma_tiles
@pytest.mark.parametrize("rows", [*range(1, 14), 68, 101])
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (37, 19), (200, 384)])
def test_the_fma_tiles_compute_f_linear_for_every_row_count_and_width(
    rows: int, out_features: int, in_features: int
) -> None:
    """Every row-tile height (1-6 or 1-12 rows, the chained one- and two-row tiles, a remainder after
    whole tiles), panels cut short by the width, any K, with and without a bias."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    expected = F.linear(x.double(), weight.double())
    torch.testing.assert_close(FmaLinear(weight, None)(x), expected.float(), rtol=1e-5, atol=1e-4)
    expected_with_bias = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(
        FmaLinear(weight, bias)(x), expected_with_bias.float(), rtol=1e-5, atol=1e-4
    )


@needs_fma_tiles
def test_the_fma_tiles_take_leading_dims_and_strided_rows() -> None:
    weight = torch.randn(40, 32)
    linear = FmaLinear(weight, None)
    batched = torch.randn(3, 5, 32)
    torch.testing.assert_close(linear(batched), F.linear(batched, weight), rtol=1e-5, atol=1e-5)
    strided = torch.randn(9, 64)[:, :32]  # rows 64 floats apart, as a split projection's
    torch.testing.assert_close(linear(strided), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


def test_other_dtypes_are_refused_by_name() -> None:
    layer = Linear(16, 8, bias=False)
    method = CpuFp32LinearMethod()
    layer.use_method(method)
    layer.weight.data = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"runs float32 weights on a CPU, not torch\.bfloat16"):
        method.process_weights_after_loading([layer], model=layer, tied_head=None)


def logged_timings(line: str) -> tuple[dict[str, float], str]:
    """The milliseconds a chooser's log line gives each kernel (by label), and the one used:
    "oneDNN 1.20 ms, ATen 2.31 ms a pass over ...; using oneDNN"."""
    listed, _, rest = line.partition(" a pass over ")
    timings = {}
    for entry in listed.split(", "):
        label, ms, unit = entry.rsplit(" ", 2)
        assert unit == "ms", line
        timings[label] = float(ms)
    return timings, rest.rpartition("; using ")[2]


def test_the_timed_choice_is_the_fastest_of_the_timings_it_logs() -> None:
    """Under kernel auto the method takes what this returns: whichever way the timing goes
    on this machine, the answer is the one its logged timings give, among every kernel
    this machine has."""
    weights = [torch.randn(1152, 384), torch.randn(384, 1536), torch.randn(1152, 384)]
    kernels = cpu_fp32.available_kernels()
    fastest, line = cpu_fp32.fastest_kernel(weights, kernels)
    assert "over 2 weight shapes" in line
    timings, using = logged_timings(line)
    assert set(timings) == {cpu_fp32.KERNEL_LABELS[k] for k in kernels}
    assert using == cpu_fp32.KERNEL_LABELS[fastest] == min(timings, key=timings.__getitem__)


def test_the_machine_offers_aten_and_every_kernel_it_can_run() -> None:
    kernels = cpu_fp32.available_kernels()
    assert kernels[-1] == "aten"
    assert ("onednn" in kernels) == cpu_fp32.onednn_available()
    assert ("fma" in kernels) == (cpu_fp32.fma_unavailable_reason() is None)


@pytest.mark.skipif(len(cpu_fp32.available_kernels()) < 2, reason="only ATen runs here")
def test_auto_keeps_the_kernel_that_timed_fastest(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger=cpu_fp32.__name__):
        model, _ = loaded_tied_llama("auto")
    [line] = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
    method = model.model.layers[0].mlp.gate_up_proj.method
    _, using = logged_timings(line)
    assert cpu_fp32.KERNEL_LABELS[method.kernel] == using


@pytest.mark.parametrize("setting", ["onednn", "fma", "aten", "auto"])
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
