"""Gemma's layers against transformers' own modules, and what the Gemma classes tell the
attention backend. The whole models are proven by tests/correctness (architecture_cases/
gemma.py); these pin the pieces whose bf16 rounding the fp32 harness cannot see."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig
from transformers.activations import ACT2FN
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2RMSNorm,
    Gemma2TextScaledWordEmbedding,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from plugserve.interfaces.model import AttentionSpec, LayerAttention
from plugserve.model_files import CheckpointError
from plugserve.worker.layers.mlp import GatedMLP
from plugserve.worker.layers.norm import GemmaRMSNorm
from plugserve.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("theirs", [Gemma2RMSNorm, Gemma3RMSNorm])
def test_gemma_rms_norm_is_transformers_bit_for_bit(dtype: torch.dtype, theirs: type) -> None:
    torch.manual_seed(0)
    x = (torch.randn(5, 48) * 3).to(dtype)
    reference = theirs(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
    ours = GemmaRMSNorm(48, 1e-6).to(dtype)
    ours.weight.data.copy_(reference.weight.data)
    with torch.no_grad():
        assert torch.equal(ours(x), reference(x))
        normed, stream = ours.add_and_norm(x, x * 2)
        assert torch.equal(stream, x * 2 + x)
        assert torch.equal(normed, reference(x * 2 + x))


def test_gelu_tanh_gated_mlp_is_transformers_gemma_mlp() -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, bias=False, hidden_act="gelu_pytorch_tanh")
    gate, up, down = torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 64)
    mlp.gate_up_proj.weight.data.copy_(torch.cat([gate, up]))
    mlp.down_proj.weight.data.copy_(down)
    x = torch.randn(7, 32)
    act = ACT2FN["gelu_pytorch_tanh"]
    expected = (act(x @ gate.T) * (x @ up.T)) @ down.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_an_unknown_activation_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unsupported hidden_act 'relu' .*gelu_pytorch_tanh"):
        GatedMLP(32, 64, bias=False, hidden_act="relu")


def gemma2_config(**overrides: object) -> Gemma2Config:
    sizes = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    return Gemma2Config(**{**sizes, **overrides})


def test_gemma2_layers_slide_on_alternate_layers_with_its_scale_and_softcap() -> None:
    config = gemma2_config(
        sliding_window=512, query_pre_attn_scalar=144, attn_logit_softcapping=50.0
    )
    sliding = LayerAttention(sliding_window=512, logit_softcap=50.0, scale=1 / 12)
    full = LayerAttention(logit_softcap=50.0, scale=1 / 12)
    assert Gemma2ForCausalLM.attention_layers(config) == [sliding, full, sliding, full]


def test_gemma3_follows_layer_types_and_never_caps_attention() -> None:
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=1024,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
    )  # fmt: skip
    assert config.layer_types == kinds
    sliding, full = LayerAttention(sliding_window=1024, scale=1 / 16), LayerAttention(scale=1 / 16)
    assert Gemma3ForCausalLM.attention_layers(config) == [sliding] * 5 + [full]


def build(config: Gemma2Config, dtype: torch.dtype = torch.float32) -> Gemma2ForCausalLM:
    spec = AttentionSpec(
        num_layers=config.num_hidden_layers, num_heads=2, num_kv_heads=1, head_dim=16,
        block_size=16, dtype=dtype, device=torch.device("cpu"),
        layers=tuple(Gemma2ForCausalLM.attention_layers(config)),
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the model loader builds models
    try:
        return Gemma2ForCausalLM(hf_config=config, attention=TorchPagedAttention(spec=spec))
    finally:
        torch.set_default_dtype(previous)


def test_embeddings_scale_by_sqrt_hidden_rounded_to_the_model_dtype_as_transformers() -> None:
    # sqrt(3072) = 55.43, which transformers rounds to bf16's 55.5 before multiplying.
    config = gemma2_config(hidden_size=3072, num_hidden_layers=0, intermediate_size=8)
    ours = build(config, torch.bfloat16)
    theirs = Gemma2TextScaledWordEmbedding(64, 3072, 0, embed_scale=3072**0.5).to(torch.bfloat16)
    torch.nn.init.normal_(ours.model.embed_tokens.weight)
    theirs.weight.data.copy_(ours.model.embed_tokens.weight.data)
    ids = torch.arange(64)
    with torch.no_grad():
        assert torch.equal(ours.embed(ids), theirs(ids))
    assert ours.embed_scale.to(torch.bfloat16).item() == 55.5


def test_final_logits_are_soft_capped() -> None:
    torch.manual_seed(0)
    model = build(gemma2_config(final_logit_softcapping=2.0, num_hidden_layers=0))
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.3)
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        raw = hidden @ model.model.embed_tokens.weight.T  # tied head
        logits = model.compute_logits(hidden)
    assert logits is not None
    torch.testing.assert_close(logits, 2.0 * torch.tanh(raw / 2.0))
    assert logits.abs().max() < 2.0 < raw.abs().max()


def test_bidirectional_attention_is_refused_in_one_line() -> None:
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        build(gemma2_config(use_bidirectional_attention=True))
