"""Random-weights checkpoints: a tiny shape loads through plugserve and transformers alike
and both decode the same greedy tokens; the named GPU shapes have the right sizes."""

from __future__ import annotations

import json

import pytest
import torch

from plugserve import LLM, SamplingParams
from plugserve.worker import random_model
from plugserve.worker.model_loader import iter_weights
from plugserve.worker.random_model import SHAPES, num_parameters, write_random_model

PROMPTS = [[1, 504, 3458, 314], [28, 9, 1330, 7, 42, 42, 100, 2048, 16], [5]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random") / "tiny", "tiny", device="cpu")


def test_named_shapes_are_llama_sized():
    assert SHAPES["1b"].head_dim == 64 and SHAPES["8b"].head_dim == 128
    assert 1.0e9 < num_parameters(SHAPES["1b"]) < 1.3e9  # Llama-3.2-1B: 1.24B with its vocab
    assert 7.0e9 < num_parameters(SHAPES["8b"]) < 8.1e9  # Llama-3-8B: 8.03B with its vocab


def test_folder_holds_config_weights_and_the_embedded_tokenizer(tiny, smollm2_path):
    config = json.loads((tiny / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["eos_token_id"] == 2
    assert (tiny / "tokenizer.json").read_bytes() == (smollm2_path / "tokenizer.json").read_bytes()
    weights = dict(iter_weights(tiny))
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["model.norm.weight"], torch.ones(128, dtype=torch.bfloat16))
    std = weights["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.018 < std < 0.022


def test_same_seed_same_weights_and_a_complete_folder_is_reused(tiny, tmp_path):
    mtime = (tiny / "model.safetensors").stat().st_mtime_ns
    assert write_random_model(tiny, "tiny", device="cpu") == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == mtime
    other = write_random_model(tmp_path / "again", "tiny", device="cpu")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(dict(iter_weights(other))[name], dict(iter_weights(tiny))[name])


def test_large_checkpoints_are_sharded_with_an_index(tmp_path, monkeypatch):
    monkeypatch.setattr(random_model, "_SHARD_BYTES", 1 << 20)
    folder = write_random_model(tmp_path / "sharded", "tiny", device="cpu")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == {name for name, _ in iter_weights(folder)}


def test_plugserve_and_transformers_decode_the_same_tokens(tiny):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tiny), dtype="float32", num_threads=1, kv_cache_memory="4MiB")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    theirs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
            )
            theirs.append(out[0, len(prompt) :].tolist())
    assert ours == theirs


def _prompts() -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in PROMPTS]
