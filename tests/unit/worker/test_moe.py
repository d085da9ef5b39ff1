"""FusedMoE (layers/moe.py): routing and output against a plain-torch reference and
against transformers' own MoE blocks, loading each checkpoint form into the stacked
weights, two tensor-parallel ranks against one, and the MoE models bf16 on CPU (router
and attention packed, experts as loaded). The whole models against transformers:
tests/correctness/architecture_cases/{qwen3_moe,mixtral}.py."""

from __future__ import annotations

import logging
import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from plugserve.model_files import CheckpointError
from plugserve.worker.layers.checkpoint import load_checkpoint
from plugserve.worker.layers.linear import Linear
from plugserve.worker.layers.moe import (
    MIXTRAL_NAMES,
    QWEN_MOE_NAMES,
    ExpertCheckpointNames,
    FusedMoE,
    select_experts,
)
from plugserve.worker.linear_methods import LinearMethodChooser, give_linear_methods
from plugserve.worker.model_loader import finish_loading
from plugserve.worker.models.mixtral import MixtralForCausalLM
from plugserve.worker.models.moe_decoder import MoeDecoderForCausalLM
from plugserve.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from plugserve.worker.parallel import ParallelContext, init_parallel
from plugserve_plugins.cpu_bf16 import packed_linear
from tests.model_support import SIZES, PagedRunner, automatic_passes, make_backend

HIDDEN, EXPERTS, TOP_K = 32, 6, 2
# Uneven on two ranks: 7 + 6 rows of every expert's gate and up.
INTERMEDIATE = 13


def moe(parallel: ParallelContext | None = None, **options: Any) -> FusedMoE:
    kwargs: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        top_k=TOP_K,
        renormalize=True,
        weigh_in_fp32=False,
    )
    kwargs.update(options)
    return FusedMoE(**kwargs, parallel=parallel or ParallelContext())


class OneLayer(nn.Module):
    """A FusedMoE where a decoder layer holds it (`layers.0.mlp`), so that checkpoint
    names around it (`layers.0.mlp.experts.3.up_proj.weight`) load as in a model."""

    def __init__(self, block: FusedMoE) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = block

    @property
    def block(self) -> FusedMoE:
        return self.layers[0].mlp


def expert_checkpoint(
    names: ExpertCheckpointNames = QWEN_MOE_NAMES, block: str = "mlp", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random router and per-expert tensors under a family's checkpoint names."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    prefix = f"layers.0.{block}"
    tensors = {f"{prefix}.gate.weight": rand(EXPERTS, HIDDEN)}
    for e in range(EXPERTS):
        tensors[f"{prefix}.experts.{e}.{names.gate}.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[f"{prefix}.experts.{e}.{names.up}.weight"] = rand(INTERMEDIATE, HIDDEN)
        tensors[f"{prefix}.experts.{e}.{names.down}.weight"] = rand(HIDDEN, INTERMEDIATE)
    return tensors


def loaded(
    block: FusedMoE,
    tensors: dict[str, torch.Tensor],
    names: ExpertCheckpointNames = QWEN_MOE_NAMES,
) -> FusedMoE:
    layer = OneLayer(block)
    load_checkpoint(layer, names.unstack(tensors.items()), {}, route=names.route)
    return layer.block


def reference_moe(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], renormalize: bool
) -> torch.Tensor:
    """Plain torch in float64, one token at a time: the softmax of the router's logits,
    its TOP_K largest (renormalized or not), each chosen expert's down(silu(gate) * up)
    scaled by its probability, summed."""
    p = "layers.0.mlp"
    w = {name: t.double() for name, t in tensors.items()}
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, token in enumerate(x.double()):
        probs = torch.softmax(w[f"{p}.gate.weight"] @ token, dim=0)
        top, ids = probs.topk(TOP_K)
        if renormalize:
            top = top / top.sum()
        for prob, e in zip(top, ids.tolist(), strict=True):
            gate = w[f"{p}.experts.{e}.gate_proj.weight"] @ token
            up = w[f"{p}.experts.{e}.up_proj.weight"] @ token
            out[t] += prob * (w[f"{p}.experts.{e}.down_proj.weight"] @ (F.silu(gate) * up))
    return out


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_takes_the_top_k_of_the_fp32_softmax_over_all_experts(renormalize: bool) -> None:
    logits = torch.randn(9, EXPERTS, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits.bfloat16(), TOP_K, renormalize)
    assert weights.dtype == torch.float32  # whatever the activations' dtype
    probs = torch.softmax(logits.bfloat16().float(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :TOP_K]
    assert torch.equal(ids, expected_ids)
    chosen = probs.gather(1, expected_ids)
    if renormalize:
        torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    else:
        torch.testing.assert_close(weights, chosen)


@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("renormalize", [True, False])
def test_output_is_each_tokens_top_k_experts_weighted_by_the_router(
    renormalize: bool, tokens: int
) -> None:
    """One token leaves most experts without tokens; 37 reach every expert."""
    tensors = expert_checkpoint()
    block = loaded(moe(renormalize=renormalize), tensors)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        actual = block(x)
    expected = reference_moe(x, tensors, renormalize)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_output_is_transformers_block_bit_for_bit(family: str) -> None:
    """In bf16 the families differ in where the routing weight is rounded: Qwen3-MoE
    rounds it to bf16 before scaling an expert's output, Mixtral scales by the fp32
    weight and rounds the product. Each block runs transformers' operations on the same
    rows of each expert, so the outputs agree exactly; with the other family's rounding
    they would not (checked below)."""
    torch.manual_seed(0)
    if family == "qwen3_moe":
        hf: nn.Module = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(
                hidden_size=HIDDEN,
                moe_intermediate_size=INTERMEDIATE,
                num_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
                norm_topk_prob=True,
            )
        )
    else:
        hf = MixtralSparseMoeBlock(
            MixtralConfig(
                hidden_size=HIDDEN,
                intermediate_size=INTERMEDIATE,
                num_local_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
            )
        )
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
    hf = hf.bfloat16().eval()
    x = torch.randn(57, HIDDEN).bfloat16()

    def ours(weigh_in_fp32: bool) -> torch.Tensor:
        block = moe(weigh_in_fp32=weigh_in_fp32)
        with torch.no_grad():
            block.gate.weight.copy_(hf.gate.weight)
            block.w13.copy_(hf.experts.gate_up_proj)  # transformers 5 holds them stacked
            block.w2.copy_(hf.experts.down_proj)
        with torch.inference_mode():
            return block.bfloat16()(x)

    with torch.inference_mode():
        expected = hf(x[None])[0]
    mixtral = family == "mixtral"
    torch.testing.assert_close(ours(weigh_in_fp32=mixtral), expected, atol=0, rtol=0)
    assert not torch.equal(ours(weigh_in_fp32=not mixtral), expected)


# --------------------------------------------------------------------------- loading


def test_each_expert_tensor_lands_in_its_slice_of_the_stacked_weights() -> None:
    tensors = expert_checkpoint()
    block = loaded(moe(), tensors)
    p = "layers.0.mlp.experts"
    for e in range(EXPERTS):
        assert torch.equal(block.w13[e, :INTERMEDIATE], tensors[f"{p}.{e}.gate_proj.weight"])
        assert torch.equal(block.w13[e, INTERMEDIATE:], tensors[f"{p}.{e}.up_proj.weight"])
        assert torch.equal(block.w2[e], tensors[f"{p}.{e}.down_proj.weight"])
    assert torch.equal(block.gate.weight, tensors["layers.0.mlp.gate.weight"])


def test_mixtral_names_and_transformers_5_stacked_tensors_load_the_same_weights() -> None:
    """Mixtral's checkpoints: `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down).
    transformers 5's modules: `mlp.experts.gate_up_proj` [E, 2 * I, H] and
    `mlp.experts.down_proj` [E, H, I], one tensor for all experts."""
    qwen = expert_checkpoint(QWEN_MOE_NAMES)
    mixtral = {
        name.replace(".mlp.", ".block_sparse_moe.")
        .replace("gate_proj", "w1")
        .replace("up_proj", "w3")
        .replace("down_proj", "w2"): tensor
        for name, tensor in qwen.items()
    }
    p = "layers.0.mlp"
    stacked = {
        f"{p}.gate.weight": qwen[f"{p}.gate.weight"],
        f"{p}.experts.gate_up_proj": torch.stack(
            [
                torch.cat(
                    [
                        qwen[f"{p}.experts.{e}.gate_proj.weight"],
                        qwen[f"{p}.experts.{e}.up_proj.weight"],
                    ]
                )
                for e in range(EXPERTS)
            ]
        ),
        f"{p}.experts.down_proj": torch.stack(
            [qwen[f"{p}.experts.{e}.down_proj.weight"] for e in range(EXPERTS)]
        ),
    }
    reference = loaded(moe(), qwen)
    for block in (
        loaded(moe(), mixtral, MIXTRAL_NAMES),
        loaded(moe(), stacked, QWEN_MOE_NAMES),
        loaded(moe(), stacked, MIXTRAL_NAMES),
    ):
        assert torch.equal(block.w13, reference.w13)
        assert torch.equal(block.w2, reference.w2)
        assert torch.equal(block.gate.weight, reference.gate.weight)


def test_a_missing_expert_projection_is_named() -> None:
    tensors = expert_checkpoint()
    del tensors["layers.0.mlp.experts.4.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing 1 weights.*mlp\.w13\[\(4, 1\)\]"):
        loaded(moe(), tensors)


def test_an_expert_the_model_does_not_have_is_refused() -> None:
    tensors = expert_checkpoint()
    tensors[f"layers.0.mlp.experts.{EXPERTS}.up_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN)
    with pytest.raises(CheckpointError, match=rf"experts\.{EXPERTS}\.up_proj.*no place"):
        loaded(moe(), tensors)


def test_an_expert_tensor_of_the_wrong_shape_is_refused() -> None:
    tensors = expert_checkpoint()
    tensors["layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN)
    with pytest.raises(CheckpointError, match=r"experts\.1\.down_proj.*has shape"):
        loaded(moe(), tensors)


def test_unsupported_options_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        moe(hidden_act="gelu")
    with pytest.raises(ValueError, match=f"to 7 of {EXPERTS} experts"):
        moe(top_k=7)


# --------------------------------------------------------------------------- 2 gloo ranks


def _rank_main(rank: int, port: int, weights_path: str, out_path: str) -> None:
    parallel = init_parallel(
        rank=rank,
        world_size=2,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=port,
        device=torch.device("cpu"),
        timeout_s=30,
    )
    torch.set_num_threads(1)
    tensors, x = torch.load(weights_path)
    block = loaded(moe(parallel), tensors)
    with torch.inference_mode():
        out = block(x)
    torch.save(
        {"out": out, "w13_rows": block.w13.shape[1], "w2_cols": block.w2.shape[2]},
        f"{out_path}.{rank}",
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_ranks_each_holding_a_slice_of_every_expert_give_the_unsharded_output(
    tmp_path: Path,
) -> None:
    tensors = expert_checkpoint()
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights_path, out_path = tmp_path / "weights.pt", tmp_path / "out.pt"
    torch.save((tensors, x), weights_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, str(weights_path), str(out_path)))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    # Gate and up: 7 + 6 rows each of every expert; down: the same 7 + 6 columns.
    assert [r["w13_rows"] for r in ranks] == [2 * 7, 2 * 6]
    assert [r["w2_cols"] for r in ranks] == [7, 6]
    with torch.inference_mode():
        expected = loaded(moe(), tensors)(x)
    for r in ranks:  # every rank holds the all-reduced sum
        torch.testing.assert_close(r["out"], expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- bf16 on CPU


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            Qwen3MoeConfig(
                **SIZES,
                num_experts_per_tok=2,
                num_experts=8,
                moe_intermediate_size=32,
                mlp_only_layers=[0],
            ),
            id="qwen3-moe-dense-layer-0",
        ),
        pytest.param(
            MixtralConfig(**SIZES, num_experts_per_tok=2, num_local_experts=4), id="mixtral"
        ),
    ],
)
def test_bf16_on_cpu_packs_router_and_attention_and_keeps_the_experts_stacked(
    config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """finish_loading measures a kernel plan on the model's linears (the
    router among them) and packs them; the experts' stacked weights are no Linear and
    stay as loaded, for ATen; the start-up log says the fused CPU decoder declined the
    experts' layers (and took Qwen3-MoE's dense one); the logits are the unpacked bf16
    model's within bf16 rounding."""
    model_cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else MixtralForCausalLM
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.1)

    def build() -> MoeDecoderForCausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            backend = make_backend(config, num_blocks=16, dtype=torch.bfloat16)
            model = model_cls(hf_config=config, attention=backend)
            chooser = LinearMethodChooser(dtype=torch.bfloat16, device=torch.device("cpu"))
            give_linear_methods(model, chooser)
        finally:
            torch.set_default_dtype(previous)
        model.load_weights(hf_model.state_dict().items())  # transformers 5's stacked experts
        return model.eval()

    plain, fast = build(), build()
    with caplog.at_level(logging.INFO):
        finish_loading(fast, automatic_passes())

    blocks = [m for m in fast.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == (1 if isinstance(config, Qwen3MoeConfig) else 2)
    if packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        assert fast.kernel_plan is not None
        assert all(m.packed is not None for m in fast.modules() if isinstance(m, Linear))
        assert all(b.gate.packed is not None for b in blocks)
        assert "generic modules: fused_cpu_decoder: its MLP is a FusedMoE" in caplog.text
        dense = isinstance(config, Qwen3MoeConfig)  # its layer 0
        assert ("layer 0: fused bf16 CPU layer" in caplog.text) == dense
    for block, as_loaded in zip(
        blocks, (m for m in plain.modules() if isinstance(m, FusedMoE)), strict=True
    ):
        assert torch.equal(block.w13, as_loaded.w13) and torch.equal(block.w2, as_loaded.w2)

    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (70, 3, 20)]
    rows = [(str(i), p) for i, p in enumerate(prompts)]
    expected = PagedRunner(plain, plain.model.layers[0].self_attn.attention, 16).step(rows)
    actual = PagedRunner(fast, fast.model.layers[0].self_attn.attention, 16).step(rows)
    torch.testing.assert_close(actual, expected, atol=0.05, rtol=0.05)
