"""The fused_cpu_decoder model pass against the modules it replaces: bf16 on a CPU it runs
each layer it can as a FusedCpuDecoderLayer, and the whole stack as one op where every
linear runs cpu_gemm.cpp, computing what the modules compute within bf16 rounding (and
what transformers computes, for the architectures it newly takes: Qwen3's q/k norm,
SmolLM3's NoPE layers, Phi-3's partial rotary factor); it declines, saying why, the layers
it cannot run, and the start-up log says which path each layer runs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from plugserve_smollm3.model import SmolLM3ForCausalLM
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from plugserve import ops
from plugserve.worker import cpu_ops
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.linear import Linear
from plugserve.worker.model_loader import finish_loading
from plugserve.worker.models.gemma import Gemma2ForCausalLM
from plugserve.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from plugserve.worker.models.mistral import MistralForCausalLM
from plugserve.worker.models.phi3 import Phi3ForCausalLM
from plugserve.worker.models.qwen3 import Qwen3ForCausalLM
from plugserve.worker.parallel import ParallelContext
from plugserve_plugins.cpu_bf16 import cpu_features, kernel_setting, linear_method, packed_linear
from plugserve_plugins.cpu_bf16.fused_layer import FusedCpuDecoderLayer
from plugserve_plugins.cpu_bf16.fused_stack import FusedCpuDecoder
from plugserve_plugins.cpu_bf16.kernel_plan import ROW_BUCKETS
from tests.model_support import (
    SIZES,
    PagedRunner,
    automatic_passes,
    bf16_model,
    make_backend,
)

# The fused CPU ops (cpu_ops.cpp), built wherever there is a C++ compiler, on any CPU.
OPS_MISSING = cpu_ops.unavailable_reason()
needs_fused_ops = pytest.mark.skipif(OPS_MISSING is not None, reason=f"cpu_ops.cpp: {OPS_MISSING}")
PACKS = packed_linear.packing_supported(torch.bfloat16, torch.device("cpu"))
# Random tiny models have logits of ~±1; bf16 steps there are 2^-8 relative.
BF16_TOLERANCE = dict(atol=0.05, rtol=0.05)
# A plan as measured on a CPU with AMX: cpu_gemm for decode up to 8 rows, oneDNN's AMX
# tiles above, long prefill chunks' MLPs as oneDNN post-ops.
MIXED_PLAN = "own/tiled,own,onednn,onednn,onednn/fused-mlp"


def hf_model_of(config: Any) -> Any:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms near, not at, 1 (as trained), so that a misread one shows
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    return hf_model


def loaded(model_cls: type, config: Any, hf_model: Any, parallel: Any = None) -> Any:
    model, _ = bf16_model(model_cls, config, num_blocks=16, parallel=parallel)
    model.load_weights(hf_model.state_dict().items())
    return model


def steps(model: Any) -> torch.Tensor:
    """A mixed prefill (a prefill chunk's row count, where oneDNN's prefill MLP runs where
    planned), then two decode steps; each row's last logits."""
    runner = PagedRunner(model, model.model.layers[0].self_attn.attention, 16)
    prompts = [
        torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
        for n in (100, 3, 40)
    ]
    out = [runner.step([(str(i), p.tolist()) for i, p in enumerate(prompts)])]
    for token in (7, 9):
        out.append(runner.step([(str(i), [token]) for i in range(len(prompts))]))
    return torch.cat(out)


def hf_steps(hf_model: Any) -> torch.Tensor:
    """`steps` as transformers computes it in bf16: each prompt, then each decode token
    appended, its last logits."""
    model = hf_model.to(torch.bfloat16)
    rows: list[list[torch.Tensor]] = [[], [], []]
    prompts = [
        torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
        for n in (100, 3, 40)
    ]
    with torch.no_grad():
        for prompt in prompts:
            ids = prompt.tolist()
            for step, token in enumerate((None, 7, 9)):
                ids = ids if token is None else [*ids, token]
                rows[step].append(model(torch.tensor([ids])).logits[0, -1].float())
    hf_model.float()
    return torch.cat([torch.stack(r) for r in rows])


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **BF16_TOLERANCE)
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.99


# --------------------------------------------------------------------------- Llama, Qwen2


@needs_fused_ops
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(LlamaConfig(**SIZES, tie_word_embeddings=True), id="llama-tied"),
        pytest.param(Qwen2Config(**SIZES, tie_word_embeddings=False), id="qwen2-qkv-bias"),
    ],
)
@pytest.mark.parametrize("kernel", ["own", "onednn", "mixed", "unpacked"])
def test_bf16_on_cpu_switches_to_the_fused_path_with_the_same_logits(
    config: Any, kernel: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The pass moves a bf16 CPU model onto the fused ops and packed matmuls; it computes
    what the plain ATen path computes, within bf16 rounding. "own" takes the path of
    AVX512-BF16 CPUs without AMX (cpu_gemm.cpp, the stack as one FusedCpuDecoder),
    wherever this CPU can run it; "onednn" that of CPUs without AVX512-BF16; "mixed" a
    plan of both, by row count, prefill-sized MLPs as oneDNN post-ops; "unpacked" that of
    a CPU where neither kernel packs bf16, the layers then calling the Linear modules."""
    if kernel in ("own", "onednn"):
        request.getfixturevalue(f"{kernel}_kernel")  # conftest.py: forced, or skipped saying why
    if kernel == "mixed":
        request.getfixturevalue("own_kernel")
        request.getfixturevalue("onednn_kernel")
        monkeypatch.setenv(kernel_setting.KERNEL_ENV, MIXED_PLAN)
    if kernel == "unpacked":
        monkeypatch.setattr(linear_method, "packing_supported", lambda dtype, device: False)
    model_cls = Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM
    hf_model = hf_model_of(config)
    plain, fast = loaded(model_cls, config, hf_model), loaded(model_cls, config, hf_model)
    finish_loading(plain)  # no model pass: the modules
    routes = finish_loading(fast, automatic_passes())

    assert all(route.taken for route in routes)
    assert fast.rotary.cos_sin is not None and plain.rotary.cos_sin is None
    assert fast.model.norm.fused and not plain.model.norm.fused
    # Every layer runs the one-frame-per-layer path, or, where every linear runs cpu_gemm,
    # the whole stack runs as FusedCpuDecoder (one op between two attention calls)...
    assert all(isinstance(f, FusedCpuDecoderLayer) for f in fast.layer_fns)
    own_kernel = kernel in ("own", "mixed")  # every weight has cpu_gemm's layout
    assert isinstance(fast.whole_stack, FusedCpuDecoder) == own_kernel
    assert plain.whole_stack is None
    assert all(isinstance(f, PreNormDecoderLayer) for f in plain.layer_fns)
    if kernel == "unpacked":  # ...through the Linear modules when nothing is packed
        assert all(m.packed is None for m in fast.modules() if isinstance(m, Linear))
        assert all(isinstance(f.qkv_proj, Linear) for f in fast.layer_fns)
    elif PACKS:
        packed = [m for m in fast.modules() if isinstance(m, Linear) and m.packed is not None]
        assert len(packed) == sum(isinstance(m, Linear) for m in fast.modules())
        assert all(m.packed.own_kernel == own_kernel for m in packed)
        # The packed copies replace the loaded weights, which are freed...
        assert all(m.weight.numel() == 0 for m in packed)
        with pytest.raises(RuntimeError, match="packed"):
            fast.load_weights(hf_model.state_dict().items())
        if own_kernel:  # ...lying one after the other in one buffer,
            # in the order a step reads them, the LM head (a module or tied) last...
            weights = [m.packed.weight for m in packed]
            tied_head = fast.model.embed_tokens.packed_head
            if tied_head is not None:
                weights.append(tied_head.weight)
            starts = [w.data_ptr() for w in weights]
            ends = [w.data_ptr() + 2 * w.numel() for w in weights]
            assert starts[1:] == ends[:-1]
            assert starts[0] % ops.HUGE_PAGE_BYTES == 0
        # ...and on one rank the layers call the packed weights directly.
        assert all(isinstance(f.down_proj, packed_linear.PackedLinear) for f in fast.layer_fns)
        assert fast.kernel_plan is not None
        assert all((f.fused_mlp is not None) == fast.kernel_plan.fused_mlp for f in fast.layer_fns)
        if kernel == "mixed":
            assert fast.kernel_plan.fused_mlp and not fast.whole_stack.runs(143)

    assert_close_to(steps(fast), steps(plain))


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
def test_the_layer_stack_in_one_op_computes_what_one_op_per_stretch_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the attention backend offers its kernel as a C++ call (cpu_layer_call), the
    whole stack runs as decode_layers; it makes the same calls in the same order as the
    per-stretch loop, so prefill and decode logits are equal bit for bit."""
    # cpu_gemm's vector kernel for every row count, as the stack runs it (a measured plan
    # may give some buckets AMX tiles, which run layer by layer).
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, ",".join(["own"] * len(ROW_BUCKETS)))
    config = LlamaConfig(**SIZES, tie_word_embeddings=True)
    hf_model = hf_model_of(config)

    def build() -> tuple[LlamaForCausalLM, Any]:
        model, backend = bf16_model(LlamaForCausalLM, config, num_blocks=16)
        model.load_weights(hf_model.state_dict().items())
        finish_loading(model, automatic_passes())
        assert isinstance(model.whole_stack, FusedCpuDecoder)
        return model, backend

    (one_op, one_op_backend), (per_stretch, per_stretch_backend) = build(), build()
    one_op_calls: list[tuple[int, int] | None] = []
    offered = one_op_backend.cpu_layer_call
    monkeypatch.setattr(
        one_op_backend, "cpu_layer_call", lambda: one_op_calls.append(offered()) or offered()
    )
    # A backend without the C++ call: the decoder falls back to one op per stretch.
    monkeypatch.setattr(per_stretch_backend, "cpu_layer_call", lambda: None)

    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (20, 3, 40)]
    plan = [
        [(str(i), p) for i, p in enumerate(prompts)],  # prefill
        [(str(i), [7 + i]) for i in range(3)],  # decode, every row
        [("1", [9])],  # decode, one row
    ]
    a, b = (
        PagedRunner(one_op, one_op_backend, 16),
        PagedRunner(per_stretch, per_stretch_backend, 16),
    )
    for rows in plan:
        assert torch.equal(a.step(rows), b.step(rows))
    assert len(one_op_calls) == len(plan) and all(c is not None for c in one_op_calls)


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
def test_the_stack_runs_every_cpu_gemm_bucket_in_that_buckets_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan that streams one row and runs more on AMX tiles (as measured plans on AMX
    CPUs do) runs the whole stack at every row count, each in its bucket's mode, and
    computes what the layers do one by one through the same plan."""
    if not cpu_features.amx_available():
        pytest.skip("no AMX tiles on this CPU")
    plan = ["own"] + ["own/amx"] * (len(ROW_BUCKETS) - 1)
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, ",".join(plan))
    config = LlamaConfig(**SIZES, tie_word_embeddings=True)
    hf_model = hf_model_of(config)

    def build() -> tuple[LlamaForCausalLM, Any]:
        model, backend = bf16_model(LlamaForCausalLM, config, num_blocks=16)
        model.load_weights(hf_model.state_dict().items())
        finish_loading(model, automatic_passes())
        assert isinstance(model.whole_stack, FusedCpuDecoder)
        return model, backend

    (stacked, stacked_backend), (layered, layered_backend) = build(), build()
    assert all(stacked.whole_stack.runs(rows) for rows in (1, 3, 63))
    monkeypatch.setattr(layered.whole_stack, "runs", lambda rows: False)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (20, 3, 40)]
    steps = [
        [(str(i), p) for i, p in enumerate(prompts)],  # prefill: 63 rows, AMX tiles
        [(str(i), [7 + i]) for i in range(3)],  # decode, 3 rows: AMX tiles
        [("1", [9])],  # decode, one row: the stream
    ]
    a, b = PagedRunner(stacked, stacked_backend, 16), PagedRunner(layered, layered_backend, 16)
    for rows in steps:
        assert_close_to(a.step(rows), b.step(rows))


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
def test_the_layer_stack_op_rejects_a_missing_attention_call_and_an_unknown_layer() -> None:
    import numpy as np

    from plugserve.interfaces.model import AttentionBatch

    model, _ = bf16_model(LlamaForCausalLM, LlamaConfig(**SIZES), num_blocks=4)
    finish_loading(model, automatic_passes())
    stack = model.whole_stack
    assert isinstance(stack, FusedCpuDecoder)
    qkv = torch.zeros(1, (4 + 2 * 2) * 16, dtype=torch.bfloat16)
    residual = torch.zeros(1, 64, dtype=torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.long)
    decode_layers = torch.ops.plugserve_decoder.decode_layers
    with pytest.raises(RuntimeError, match="no attention call"):
        decode_layers(stack.stack, qkv, residual, positions, 0, 0, stack.mode_by_bucket[0])
    # The two-layer stack against a backend whose cache holds one layer.
    one_layer = make_backend(
        LlamaConfig(**{**SIZES, "num_hidden_layers": 1}), num_blocks=4, dtype=torch.bfloat16
    )
    one_layer.prepare(
        AttentionBatch(
            query_start_loc=np.array([0, 1], dtype=np.int32),
            seq_lens=np.array([1], dtype=np.int32),
            block_table=np.zeros((1, 1), dtype=np.int32),
            slot_mapping=np.zeros(1, dtype=np.int64),
        )
    )
    call = one_layer.cpu_layer_call()
    assert call is not None
    with pytest.raises(RuntimeError, match="layer 1 is outside the cache"):
        decode_layers(stack.stack, qkv, residual, positions, *call, stack.mode_by_bucket[0])


@pytest.mark.skipif(not PACKS or OPS_MISSING is not None, reason="no bf16 packing or fused ops")
def test_a_tensor_parallel_shard_keeps_the_all_reduce_of_its_row_parallel_layers() -> None:
    """Rank 0 of 2, bf16 on CPU: the fused layers call the column-parallel projections'
    packed weights, but the row-parallel ones (o_proj, down_proj) through their modules,
    whose forward sums the partial products over ranks; the whole stack, one rank's op,
    is declined with the reason."""
    model, _ = bf16_model(
        LlamaForCausalLM, LlamaConfig(**SIZES), num_blocks=1, parallel=ParallelContext(0, 2)
    )
    routes = finish_loading(model, automatic_passes())
    assert model.whole_stack is None
    assert all(r.taken and "tensor-parallel ranks" in r.why for r in routes)
    for layer, fused in zip(model.model.layers, model.layer_fns, strict=True):
        assert isinstance(fused, FusedCpuDecoderLayer)
        assert fused.qkv_proj is layer.self_attn.qkv_proj.packed
        assert fused.gate_up_proj is layer.mlp.gate_up_proj.packed
        assert fused.o_proj is layer.self_attn.o_proj
        assert fused.down_proj is layer.mlp.down_proj


# --------------------------------------------------------------------------- the others


def qwen3_config() -> Qwen3Config:
    """Qwen3's q/k norm, a head_dim that is not hidden / heads, untied head."""
    return Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=False)


def smollm3_config() -> SmolLM3Config:
    """Three layers, the middle one NoPE, with a window on it; biases; tied."""
    return SmolLM3Config(
        **{**SIZES, "num_hidden_layers": 3},
        no_rope_layers=[1, 0, 1],
        use_sliding_window=True,
        sliding_window=12,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    )


def phi3_config(partial: float) -> Phi3Config:
    """longrope (its scaled table in the rotary op), a window, and where partial < 1 a
    partial rotary factor (only part of each head rotates)."""
    pairs = int(16 * partial) // 2
    return Phi3Config(
        **SIZES,
        tie_word_embeddings=False,
        sliding_window=24,
        original_max_position_embeddings=16,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [1.0 + 2.0 * i for i in range(pairs)],
            "original_max_position_embeddings": 16,
            "partial_rotary_factor": partial,
        },
    )


ARCHITECTURES = [
    pytest.param(Qwen3ForCausalLM, qwen3_config(), id="qwen3-qk-norm"),
    pytest.param(SmolLM3ForCausalLM, smollm3_config(), id="smollm3-nope-window"),
    pytest.param(
        MistralForCausalLM,
        MistralConfig(**SIZES, head_dim=32, sliding_window=8),
        id="mistral-window",
    ),
    pytest.param(Phi3ForCausalLM, phi3_config(1.0), id="phi3-longrope"),
    pytest.param(Phi3ForCausalLM, phi3_config(0.75), id="phi3-partial-rotary"),
]


# cpu_gemm's vector kernel for every row count, unmeasured: the whole stack runs every step.
ALL_OWN = ",".join(["own"] * len(ROW_BUCKETS))


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
@pytest.mark.parametrize(("model_cls", "config"), ARCHITECTURES)
def test_every_layer_runs_fused_and_the_stack_as_one_op_with_the_modules_logits(
    model_cls: type,
    config: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen3 (q/k norm over each head before RoPE), the SmolLM3 example (a layer without
    rotation, its window the backend's), Mistral (head_dim 32, a window), Phi-3 (longrope,
    a partial rotary factor): the pass takes every layer and the whole stack, and the
    logits are the modules' and transformers' in bf16, within bf16 rounding."""
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, ALL_OWN)
    hf_model = hf_model_of(config)
    plain, fast = loaded(model_cls, config, hf_model), loaded(model_cls, config, hf_model)
    finish_loading(plain)
    with caplog.at_level(logging.INFO, logger="plugserve.worker.model_passes"):
        routes = finish_loading(fast, automatic_passes())

    assert all(route.taken for route in routes), routes
    assert all(isinstance(f, FusedCpuDecoderLayer) for f in fast.layer_fns)
    assert isinstance(fast.whole_stack, FusedCpuDecoder)
    assert not fast.rotary.gathers  # every rotating layer rotates in the fused op
    rotates = [layer.self_attn.rotate for layer in fast.model.layers]
    assert [f.cos_sin is not None for f in fast.layer_fns] == rotates
    assert all((f.q_norm is not None) == (model_cls is Qwen3ForCausalLM) for f in fast.layer_fns)
    stack = "(the whole stack as one op (cpu_decoder.cpp) at 1, 2-8, 9-64, 65-256, 257+ rows)"
    if model_cls is SmolLM3ForCausalLM:  # the NoPE layer on a line of its own
        assert f"layers 0,2: fused bf16 CPU layer {stack}" in caplog.text
        assert f"layer 1: fused bf16 CPU layer, without rotation (NoPE) {stack}" in caplog.text
    elif model_cls is Qwen3ForCausalLM:
        assert f"layers 0,1: fused bf16 CPU layer, with q/k norm {stack}" in caplog.text
    else:
        assert f"layers 0,1: fused bf16 CPU layer {stack}" in caplog.text

    ours = steps(fast)
    assert_close_to(ours, steps(plain))
    assert_close_to(ours, hf_steps(hf_model))


@needs_fused_ops
def test_per_layer_the_fused_path_runs_qwen3_and_smollm3_where_the_stack_is_declined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no kernel packing cpu_gemm's layout (here: none packed at all), the whole stack
    is declined with the reason and every layer runs its fused function, calling the Linear
    modules; the logits are the modules'."""
    monkeypatch.setattr(linear_method, "packing_supported", lambda dtype, device: False)
    for model_cls, config in (
        (Qwen3ForCausalLM, qwen3_config()),
        (SmolLM3ForCausalLM, smollm3_config()),
    ):
        hf_model = hf_model_of(config)
        plain, fast = loaded(model_cls, config, hf_model), loaded(model_cls, config, hf_model)
        finish_loading(plain)
        routes = finish_loading(fast, automatic_passes())
        assert fast.whole_stack is None
        assert all(r.taken and "not the whole stack as one op" in r.why for r in routes)
        assert_close_to(steps(fast), steps(plain))


def test_fp32_and_layers_it_cannot_run_are_declined_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """fp32 keeps the modules (ATen's ops, bit for bit with transformers); bf16 Gemma's
    sandwich-norm layers are declined one by one, the log saying which path each runs."""
    config = LlamaConfig(**SIZES)
    model = LlamaForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    with caplog.at_level(logging.INFO, logger="plugserve.worker.model_passes"):
        routes = finish_loading(model, automatic_passes())
    assert not any(r.taken for r in routes) and model.whole_stack is None
    assert all(isinstance(f, PreNormDecoderLayer) for f in model.layer_fns)
    assert (
        "layers 0,1: generic modules: fused_cpu_decoder: the fused layers run bf16 on a CPU, "
        "the model float32 on cpu"
    ) in caplog.text

    gemma = Gemma2Config(**SIZES, head_dim=16, query_pre_attn_scalar=16)
    model, _ = bf16_model(Gemma2ForCausalLM, gemma, num_blocks=1)
    routes = finish_loading(model, automatic_passes())
    if OPS_MISSING is None:
        assert [r.why for r in routes] == [
            "fused_cpu_decoder: it is a SandwichNormDecoderLayer, not a PreNormDecoderLayer"
        ] * 2
    assert model.whole_stack is None and not model.model.norm.fused


def test_no_pass_selected_leaves_the_modules_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    model, _ = bf16_model(LlamaForCausalLM, LlamaConfig(**SIZES), num_blocks=1)
    with caplog.at_level(logging.INFO, logger="plugserve.worker.model_passes"):
        routes = finish_loading(model, [])
    assert [r.why for r in routes] == ["no model pass"] * 2
    assert "(model passes: none):\n  layers 0,1: generic modules: no model pass" in caplog.text
    assert all(isinstance(f, PreNormDecoderLayer) for f in model.layer_fns)
