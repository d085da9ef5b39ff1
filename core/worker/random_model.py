"""Random-weights Llama-family checkpoints of any shape, for checks that need no weights.

`write_random_model(folder, "8b")` writes an HF-style folder (config.json, sharded
safetensors, the embedded model's tokenizer files) that plugserve (`LLM(model=folder)`)
and transformers load like any checkpoint. Weights are N(0, 0.02²) from a fixed seed,
drawn on `device` (the GPU when there is one: fast) in the checkpoint dtype; norms are
ones so activations stay in a sane range. The same seed gives the same weights on the
same kind of device (CPU and CUDA draw different streams). A folder already holding the
same shape, seed and dtype is reused as is.

    python -m plugserve.worker.random_model --shape 1b --out /tmp/llama-1b [--device cuda]
    python -m plugserve.worker.random_model --export-tokenizer DIR   # for offline machines
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from plugserve.model_files import write_sharded_safetensors

# The embedded model's tokenizer: the vocabulary every shape here uses.
TOKENIZER_MODEL = "smollm2-135m-instruct"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
_MARKER = "plugserve_random.json"
_SHARD_BYTES = 4 << 30
_STD = 0.02


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vocab_size: int = 49152  # the embedded tokenizer's
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES: dict[str, LlamaShape] = {
    # Llama-3.2-1B's layers with the embedded tokenizer's vocabulary.
    "1b": LlamaShape(2048, 16, 32, 8, 8192, tie_word_embeddings=True),
    # Llama-3-8B's layers with the embedded tokenizer's vocabulary.
    "8b": LlamaShape(4096, 32, 32, 8, 14336, tie_word_embeddings=False),
    # For tests: loads and generates in well under a second; head_dim 64, which
    # FlashInfer's kernels support, and GQA.
    "tiny": LlamaShape(128, 2, 2, 1, 256, tie_word_embeddings=True, max_position_embeddings=1024),
    # A forward pass that costs next to nothing beside the real vocabulary's logits: what
    # is left of a step is the host's work (benchmarks/engine_overhead.py).
    "overhead": LlamaShape(
        64, 1, 1, 1, 128, tie_word_embeddings=True, max_position_embeddings=2048
    ),
}


def hf_config(shape: LlamaShape, dtype: torch.dtype, token_ids: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **token_ids,
    }


def tensor_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor under its Hugging Face Llama name, in writing order."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (shape.num_heads * shape.head_dim, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, shape.num_heads * shape.head_dim)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (shape.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (shape.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, shape.intermediate_size)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def num_parameters(shape: LlamaShape) -> int:
    return sum(int(torch.Size(s).numel()) for s in tensor_shapes(shape).values())


def _tokenizer_source(tokenizer_from: str | Path | None) -> Path:
    if tokenizer_from is not None:
        return Path(tokenizer_from)
    from plugserve.model_files import resolve_model_path

    return resolve_model_path(TOKENIZER_MODEL)


def export_tokenizer(dest: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Copy the tokenizer files (and config.json, for the vocabulary size and special
    ids) to `dest`: what `tokenizer_from` needs on a machine without the embedded model."""
    source, out = _tokenizer_source(tokenizer_from), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def write_random_model(
    out_dir: str | Path,
    shape: str | LlamaShape,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write (or reuse) a random-weights checkpoint folder; returns its path.
    `tokenizer_from`: a folder holding the tokenizer files (default: the embedded
    model's, converted on first use)."""
    base = SHAPES[shape] if isinstance(shape, str) else shape
    source = _tokenizer_source(tokenizer_from)
    # The vocabulary and special ids come from the tokenizer's own config when present.
    token_ids: dict[str, Any] = {}
    source_config = source / "config.json"
    if source_config.is_file():
        meta = json.loads(source_config.read_text())
        base = replace(base, vocab_size=int(meta.get("vocab_size", base.vocab_size)))
        token_ids = {k: meta[k] for k in ("bos_token_id", "eos_token_id") if k in meta}
    out = Path(out_dir)
    marker = {"shape": asdict(base), "seed": seed, "dtype": str(dtype), "std": _STD}
    marker_path = out / _MARKER
    if marker_path.is_file() and json.loads(marker_path.read_text()) == marker:
        return out
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)  # written last: its presence means complete
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    (out / "config.json").write_text(json.dumps(hf_config(base, dtype, token_ids), indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    _write_weights(out, base, seed=seed, dtype=dtype, device=device)
    marker_path.write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _write_weights(
    out: Path, shape: LlamaShape, *, seed: int, dtype: torch.dtype, device: torch.device
) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    element = torch.empty((), dtype=dtype).element_size()
    shapes = tensor_shapes(shape)

    def draw(name: str) -> torch.Tensor:
        dims = shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(dims, dtype=dtype)
        tensor = torch.empty(dims, dtype=dtype, device=device)
        return tensor.normal_(0.0, _STD, generator=generator).cpu()

    sizes = {name: int(torch.Size(dims).numel()) * element for name, dims in shapes.items()}
    write_sharded_safetensors(out, sizes, draw, shard_bytes=_SHARD_BYTES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--out", help="folder to write (reused if complete)")
    parser.add_argument(
        "--export-tokenizer", metavar="DIR", help="only copy the tokenizer files to DIR"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--device", default=None, help="where to draw weights (default: cuda if any)"
    )
    parser.add_argument("--tokenizer-from", default=None, help="folder with tokenizer files")
    args = parser.parse_args(argv)
    if args.export_tokenizer:
        print(export_tokenizer(args.export_tokenizer, args.tokenizer_from))
        return
    if not (args.shape and args.out):
        parser.error("--shape and --out are required (or --export-tokenizer)")
    path = write_random_model(
        args.out,
        args.shape,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        tokenizer_from=args.tokenizer_from,
    )
    print(path)


if __name__ == "__main__":
    main()
