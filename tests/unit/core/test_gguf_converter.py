"""The GGUF → Hugging Face folder conversion (plugserve.gguf_converter), on the real
SmolLM2: the converted config, tensors and tokenizer against the GGUF read directly and
through transformers' own GGUF loader, and the converted folder reused from the cache."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from plugserve import gguf_converter, model_files
from plugserve.model_files import BUILTIN_MODELS, load_tokenizer, resolve_model_path
from plugserve.worker.model_loader import iter_weights


def _builtin_file() -> Path:
    return model_files._builtin_file(
        "smollm2-135m-instruct", *BUILTIN_MODELS["smollm2-135m-instruct"]
    )


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, verbatim: HF → GGUF row order.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_builtin_name_resolves_to_a_hf_folder(smollm2_path: Path) -> None:
    assert smollm2_path.is_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_path / name).is_file(), name
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5  # the float32 GGUF value, restored
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == 2
    # The folder is named after the GGUF's content hash.
    assert smollm2_path.name == gguf_converter.file_sha256(_builtin_file())[:16]


def test_second_resolve_reuses_the_cache(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = smollm2_path.stat()

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(gguf_converter, "convert_gguf", no_conversion)
    assert resolve_model_path("smollm2-135m-instruct") == smollm2_path
    assert resolve_model_path(str(_builtin_file())) == smollm2_path  # same file, by path
    after = smollm2_path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_converted_tensors_equal_a_direct_dequantization(smollm2_path: Path) -> None:
    reader = gguf.GGUFReader(_builtin_file())
    source = {t.name: t for t in reader.tensors}

    def dequantized(name: str) -> np.ndarray:
        tensor = source[name]
        shape = tuple(reversed(tensor.shape.tolist()))
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)

    wanted = {
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",
    }
    ours = {name: t for name, t in iter_weights(smollm2_path) if name in wanted}
    assert set(ours) == wanted
    assert all(t.dtype == torch.float32 for t in ours.values())

    def same(name: str, expected: np.ndarray) -> None:
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=name)

    same("model.embed_tokens.weight", dequantized("token_embd.weight"))
    same("model.layers.3.self_attn.v_proj.weight", dequantized("blk.3.attn_v.weight"))
    same("model.layers.3.mlp.down_proj.weight", dequantized("blk.3.ffn_down.weight"))
    same("model.layers.3.input_layernorm.weight", dequantized("blk.3.attn_norm.weight"))
    # Q and K were reordered by llama.cpp for its rotary layout; the conversion undoes
    # that, so re-applying llama.cpp's permutation must give back the GGUF tensor.
    np.testing.assert_array_equal(
        _llama_cpp_permute(ours["model.layers.3.self_attn.q_proj.weight"].numpy(), 9),
        dequantized("blk.3.attn_q.weight"),
    )
    np.testing.assert_array_equal(
        _llama_cpp_permute(ours["model.layers.3.self_attn.k_proj.weight"].numpy(), 3),
        dequantized("blk.3.attn_k.weight"),
    )


def test_every_converted_tensor_equals_transformers_own_gguf_loading(
    smollm2_path: Path, hf_reference_model
) -> None:
    """All 272 tensors, against transformers' GGUF loader (its own names, its own undoing of
    llama.cpp's Q/K permutation): the correctness suite's reference is that loading, so a
    mismatch here would show as plugserve diverging from it, not hide on both sides."""
    reference = hf_reference_model(torch.float32).state_dict()
    ours = dict(iter_weights(smollm2_path))
    # Tied embeddings: the folder stores the table once, transformers shows it twice.
    assert torch.equal(reference.pop("lm_head.weight"), reference["model.embed_tokens.weight"])
    assert set(ours) == set(reference)
    for name, expected in reference.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], expected), name


def test_converted_tokenizer_equals_transformers_own_gguf_tokenizer(
    smollm2_path: Path, smollm2_gguf: Path
) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours = load_tokenizer(smollm2_path)
    text = "Gutenberg's press, 1450: héllo 日本語 🙂\n\tdef f(x):\n  return x<|im_end|>"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == theirs.decode(ours.encode(text))
    conversation = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    ) == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token, ours.bos_token, len(ours)) == (
        theirs.eos_token,
        theirs.bos_token,
        len(theirs),
    )


def test_saved_tokenizer_has_the_chat_template(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
