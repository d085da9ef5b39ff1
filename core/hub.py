"""A Hugging Face Hub id ("Qwen/Qwen3-0.6B") → the snapshot folder huggingface_hub keeps
for it, so that `model:` can name the checkpoint a user already has.

`hf download`, transformers and vLLM keep checkpoints in the Hugging Face cache
(`HF_HUB_CACHE`, by default ~/.cache/huggingface/hub); its snapshot folder is a plain
Hugging Face folder, which plugserve loads in place, copying nothing. The cache is looked
at first, without a network call, so a cached model starts the same online or not. With
`HF_HUB_OFFLINE` set (every test sets it) nothing is downloaded: an id the cache lacks is
an error saying how to fetch it. Without it, the files a served model needs are
downloaded into that same cache once, through huggingface_hub, as vLLM does.

No torch here: the API server resolves models too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name, as the Hub spells repository ids; never a path that exists (checked first).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# What serving a checkpoint reads: the config, the weights (sharded or not), the tokenizer
# in any of its forms, the chat template and the generation defaults. Not the .bin, .pth
# or .gguf copies some repositories carry beside the safetensors.
SERVED_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.model",
    "chat_template.*",
)

_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hub repository id ("owner/name")."""
    return _HUB_ID.fullmatch(model) is not None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now: huggingface_hub reads it once, at its import, and a
    process may set it later (as the tests' conftest does before any import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots in this process."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hub_id(repo_id: str) -> Path:
    """The cached snapshot folder of `repo_id` (its main revision), downloaded first
    unless HF_HUB_OFFLINE is set; ValueError with one line saying what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(
            snapshot_download(repo_id, local_files_only=True, allow_patterns=list(SERVED_FILES))
        )
    except LocalEntryNotFoundError:
        folder = None
    if folder is not None and _servable(folder):
        return folder
    where = f"the Hugging Face cache ({hub_cache_dir()})"
    missing = "is not in" if folder is None else "is only partly in"
    if hub_offline():
        raise ValueError(
            f"model {repo_id!r} {missing} {where} and HF_HUB_OFFLINE is set, so it is not "
            f"downloaded: fetch it first (hf download {repo_id}) or name a local folder"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(SERVED_FILES)))
    except Exception as exc:  # network, auth, unknown repository: one line, the cause kept
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"model {repo_id!r} {missing} {where} and downloading it failed: {first_line}"
        ) from exc


def _servable(folder: Path) -> bool:
    # A snapshot transformers touched for its config alone holds config.json and nothing
    # to load: then it is incomplete, not a model without weights.
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
