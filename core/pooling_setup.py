"""Whether a checkpoint is served for pooling, and how it pools, from its files alone.

Read by the API server (which endpoints apply, how long a prompt may be) and by the
engine and its workers (which runner, which pooler, whether prompts are scheduled whole)
alike, so it imports neither torch nor the worker: only the folder's JSON files.

A folder saved by sentence-transformers carries `modules.json` (the Transformer, then a
Pooling module whose `1_Pooling/config.json` names the pooling mode, then optionally
Normalize) and `sentence_bert_config.json` (its `max_seq_length`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from plugserve.config import StackConfig

# Encoders: every token attends to every other (bidirectional), so a prompt runs in one
# forward pass (never chunked) and shares no prefix-cached blocks.
ENCODER_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "BertForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    }
)
# 1_Pooling/config.json's modes → the bundled pooler of that name (max: a plugin's).
_POOLING_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_max_tokens", "max"),
)


@dataclass(frozen=True)
class PoolingSetup:
    """How a model folder is served. `runner` "generate" leaves every other field unused."""

    runner: Literal["generate", "pooling"]
    architecture: str
    # The pooler's registered name (stack.pooler, else the checkpoint's, else the default).
    pooler: str = "last"
    # Whether embeddings are L2-normalised unless a request says otherwise.
    normalize: bool = True
    # Bidirectional attention: scheduled whole, no prefix cache.
    is_encoder: bool = False
    # A classification head's labels (a ForSequenceClassification); None: an embedder.
    num_labels: int | None = None
    id2label: tuple[str, ...] = ()
    # The longest prompt the checkpoint was trained for (sentence_bert_config.json's
    # max_seq_length), where it says; caps max_model_len.
    max_seq_length: int | None = None
    # The length of an embedding (dimensions may cut it shorter, not longer).
    hidden_size: int = 0

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def tasks(self) -> tuple[str, ...]:
        """The PoolingParams tasks the model serves."""
        if not self.is_pooling:
            return ()
        if self.num_labels is not None:
            return ("classify", "score")
        return ("embed", "token_embed", "score")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def checkpoint_pooler(folder: Path) -> str | None:
    """The pooler 1_Pooling/config.json (or whatever folder modules.json names for the
    Pooling module) asks for, or None where the checkpoint has none."""
    modules = _read_json(folder / "modules.json") or []
    pooling_dirs = [
        m.get("path", "") for m in modules if str(m.get("type", "")).endswith("models.Pooling")
    ]
    for pooling_dir in pooling_dirs or ["1_Pooling"]:
        config = _read_json(folder / pooling_dir / "config.json")
        if isinstance(config, dict):
            for key, name in _POOLING_MODES:
                if config.get(key):
                    return name
    return None


def has_sentence_transformers_files(folder: Path) -> bool:
    return (folder / "modules.json").is_file()


def pooling_setup(
    folder: str | Path,
    runner: str = "auto",
    pooler: str | None = None,
) -> PoolingSetup:
    """How `folder` is served under `engine.runner` and `stack.pooler`; ValueError where
    the runner asked cannot serve the architecture."""
    folder = Path(folder)
    config = _read_json(folder / "config.json") or {}
    architecture = (config.get("architectures") or ["?"])[0]
    is_classifier = architecture.endswith("ForSequenceClassification")
    is_encoder = architecture in ENCODER_ARCHITECTURES
    pools_by_nature = is_encoder or is_classifier or architecture.endswith("Model")
    if runner == "auto":
        runner = (
            "pooling" if pools_by_nature or has_sentence_transformers_files(folder) else "generate"
        )
    if runner == "generate":
        if pools_by_nature:
            raise ValueError(
                f"{architecture} has no language-model head and cannot generate; serve it "
                "with engine.runner pooling (or auto)"
            )
        return PoolingSetup(runner="generate", architecture=architecture)
    modules = _read_json(folder / "modules.json") or []
    has_normalize = any(str(m.get("type", "")).endswith("models.Normalize") for m in modules)
    bert_config = _read_json(folder / "sentence_bert_config.json") or {}
    labels: tuple[str, ...] = ()
    num_labels = None
    if is_classifier:
        id2label = config.get("id2label") or {}
        num_labels = int(config.get("num_labels") or len(id2label) or 2)
        labels = tuple(
            str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)
        )
    default_pooler = "cls" if (is_encoder or is_classifier) else "last"
    return PoolingSetup(
        runner="pooling",
        architecture=architecture,
        pooler=pooler or checkpoint_pooler(folder) or default_pooler,
        # Without sentence-transformers files an embedder normalises (as vLLM's default).
        normalize=has_normalize if modules else True,
        is_encoder=is_encoder,
        num_labels=num_labels,
        id2label=labels,
        max_seq_length=bert_config.get("max_seq_length"),
        hidden_size=int(config.get("hidden_size") or 0),
    )


def check_pooling_stack(model_path: str | Path, config: StackConfig) -> PoolingSetup:
    """How `config` serves the model at `model_path`; ValueError (one line, naming both
    settings) where the stack selects what the runner cannot use: speculative decoding,
    pipeline stages, a reasoning parser or CUDA graphs with a pooling model, which runs
    each prompt once and generates nothing; a pooler with a generating one. Called before
    any process starts (serve, LLM)."""
    stack, engine = config.stack, config.engine
    setup = pooling_setup(model_path, engine.runner, stack.pooler)
    served = f"engine.runner {engine.runner} serves {setup.architecture}"
    if not setup.is_pooling:
        if stack.pooler is not None:
            raise ValueError(
                f"stack.pooler ({stack.pooler}) is set, but {served} to generate: set "
                "engine.runner pooling, or unset stack.pooler"
            )
        return setup
    pooling = f"{served} for pooling, which runs each prompt once and generates nothing"
    refusals = (
        (
            stack.speculative is not None,
            f"stack.speculative ({stack.speculative.proposer if stack.speculative else ''})",
            "unset stack.speculative",
        ),
        (
            engine.pipeline_parallel_size > 1,
            f"engine.pipeline_parallel_size ({engine.pipeline_parallel_size})",
            "a pooling model runs whole in each rank: set pipeline_parallel_size to 1",
        ),
        (
            stack.reasoning_parser is not None,
            f"stack.reasoning_parser ({stack.reasoning_parser})",
            "unset stack.reasoning_parser",
        ),
        (
            bool(engine.cuda_graphs),
            "engine.cuda_graphs (true)",
            "they capture decode steps only: unset engine.cuda_graphs",
        ),
    )
    for refused, setting, remedy in refusals:
        if refused:
            raise ValueError(f"{setting} cannot be used: {pooling}; {remedy}")
    return setup
