"""The GGUF converter: a GGUF file → a Hugging Face style folder (config.json, fp32
safetensors under HF names, tokenizer files with the chat template, generation_config.json),
written once into the plugserve cache and keyed by the file's content hash.

plugserve.model_files resolves a model name to a folder and calls `gguf_to_folder` when
the name is (or is built in as) a GGUF; everything after that reads the folder, so every
consumer (plugserve's models, transformers, the tokenizer) sees one format. Like
model_files it imports neither torch nor the worker at module level: the API server
converts the model before it builds its renderer.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.model_files import write_sharded_safetensors
from plugserve.user_cache import cache_root

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 20

# llama.cpp tensor names (the part after "blk.N.") → Hugging Face Llama names.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_to_folder(gguf_path: Path) -> Path:
    """The Hugging Face folder converted from `gguf_path`, under the plugserve cache and
    named after the file's content hash: converted on first use, reused afterwards."""
    digest = file_sha256(gguf_path)
    target = cache_root() / "models" / digest[:16]
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target (same filesystem) and renamed into place in one step, so a
    # concurrent process sees either no folder or a complete one.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{digest[:16]}-"))
    try:
        logger.info("converting %s into %s (once)", gguf_path, target)
        convert_gguf(gguf_path, tmp, sha256=digest)
        # mkdtemp's private mode would lock out other users of a shared cache dir.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted %s first; using its copy", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so a multi-GB GGUF is hashed
    once, not on every start."""
    stat = path.stat()
    key = hashlib.sha1(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    memo = cache_root() / "hashes" / key
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    digest = sha.hexdigest()
    with contextlib.suppress(OSError):  # an unwritable cache only costs a re-hash later
        memo.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(memo, digest)
    return digest


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def convert_gguf(gguf_path: Path, out_dir: Path, *, sha256: str = "") -> None:
    """Write config.json, fp32 safetensors under HF names, tokenizer files and
    generation_config.json for a GGUF into out_dir.

    A 'llama' GGUF (Llama, Mistral, SmolLM2, ...) is converted here one shard at a time,
    so host memory holds one shard; any other architecture transformers reads from GGUF
    (Qwen2/3, their MoE, Phi-3, Gemma 2/3, ...) through transformers' own GGUF loader,
    which holds the whole fp32 model once, during this one-time conversion.
    """
    with gguf_read_once(gguf_path) as reader:
        meta = _GgufMetadata(reader)
        if meta.arch == "llama":
            names = {t.name for t in reader.tensors}
            config = _llama_config(meta, names)
            _write_safetensors(reader, config, out_dir)
            (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        else:
            _convert_with_transformers(gguf_path, meta.arch, out_dir)
        generation = _generation_config(meta)
        if generation:
            text = json.dumps(generation, indent=2) + "\n"
            (out_dir / "generation_config.json").write_text(text)
        _save_tokenizer(gguf_path, out_dir)
    provenance = {"source": str(gguf_path), "sha256": sha256, "converter": "plugserve"}
    (out_dir / "plugserve_source.json").write_text(json.dumps(provenance, indent=2) + "\n")


@contextlib.contextmanager
def gguf_read_once(gguf_path: Path) -> Iterator[Any]:
    """While open, every gguf.GGUFReader of `gguf_path` is one reader, parsed once, and
    gguf's tensor-name map is built once per architecture and depth; yields the reader.
    transformers' GGUF loader parses the file anew for the config, for the weights and for
    the tokenizer (the vocabulary string by string: seconds each for 49k tokens), and
    builds the name map again for every tensor; what they read is the same."""
    import gguf

    make_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = make_reader(gguf_path)
    target = Path(gguf_path).resolve()

    def reader_of(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(path).resolve() == target:
            return parsed
        return make_reader(path, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_of, functools.cache(name_map)
    try:
        yield parsed
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def _convert_with_transformers(gguf_path: Path, arch: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    if arch not in readable:
        raise ValueError(
            f"GGUF architecture {arch!r} ({gguf_path.name}) is not supported: plugserve "
            f"converts 'llama' GGUFs and, through transformers, {', '.join(readable)}"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from GGUF; its config and dequantized
    # tensors are all a folder needs. A tied head is the embedding, stored once.
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):  # the folder holds fp32 tensors, not GGUF
        del config.quantization_config
    if hasattr(config, "rms_norm_eps"):  # GGUF's float32, back to the value it was
        config.rms_norm_eps = _f32(config.rms_norm_eps)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    config.save_pretrained(str(out_dir))
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()}
    write_sharded_safetensors(out_dir, sizes, lambda name: state[name].contiguous())


class _GgufMetadata:
    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def count(self, key: str) -> int:
        field = self._fields.get(key)
        return 0 if field is None else len(field.data)


def _f32(value: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr recovers the value the
    # original config held (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _llama_config(meta: _GgufMetadata, tensor_names: set[str]) -> dict[str, Any]:
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF has per-frequency RoPE factors (rope_freqs), not supported")
    hidden = int(meta.arch_key("embedding_length"))
    heads = int(meta.arch_key("attention.head_count"))
    scaling_type = meta.arch_key("rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(meta.arch_key("rope.scaling.factor"))}
    elif scaling_type == "none":
        rope_scaling = None
    else:
        raise ValueError(f"GGUF RoPE scaling {scaling_type!r} is not supported")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_key("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch_key("attention.head_count_kv", heads)),
        "head_dim": int(meta.arch_key("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.arch_key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.arch_key("context_length", 2048)),
        "vocab_size": int(meta.arch_key("vocab_size", meta.count("tokenizer.ggml.tokens"))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    return config


def _generation_config(meta: _GgufMetadata) -> dict[str, Any]:
    # End-of-generation tokens beyond eos (a chat model's end-of-turn) belong in the
    # generation config, which is where HF and our engine look for stop ids.
    stops: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) not in stops:
            stops.append(int(token_id))
    if not stops:
        return {}
    generation: dict[str, Any] = {"eos_token_id": stops[0] if len(stops) == 1 else stops}
    for key, gguf_key in (("bos", "bos"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            generation[f"{key}_token_id"] = int(token_id)
    return generation


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp's tensor name → the Hugging Face Llama name; ValueError if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved rotary pairs) back to HF's
    rotate-half layout; `num_heads` is the heads this projection has (KV heads for K)."""
    half = weight.shape[0] // num_heads // 2
    shaped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _dequantized(tensor: Any, config: dict[str, Any]) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
    stem = tensor.name.rpartition(".")[0]
    if stem.endswith(".attn_q"):
        array = unpermute_rotary(array, config["num_attention_heads"])
    elif stem.endswith(".attn_k"):
        array = unpermute_rotary(array, config["num_key_value_heads"])
    return np.ascontiguousarray(array)


def _write_safetensors(reader: Any, config: dict[str, Any], out_dir: Path) -> None:
    import torch  # here, not at the top: the API server imports this module too
    from tqdm import tqdm

    by_name = {hf_tensor_name(t.name): t for t in reader.tensors}
    sizes = {name: int(np.prod(by_name[name].shape)) * 4 for name in sorted(by_name)}
    bar = tqdm(total=len(sizes), desc="dequantizing GGUF", disable=not sys.stderr.isatty())

    def dequantize(name: str) -> torch.Tensor:
        bar.update()
        return torch.from_numpy(_dequantized(by_name[name], config))

    with bar:
        write_sharded_safetensors(out_dir, sizes, dequantize)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
