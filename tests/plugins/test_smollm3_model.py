"""The out-of-tree model package (tests/plugins/plugserve-smollm3), installed as a third
party's would be (`pip install --no-deps -e`, Makefile): plugserve lists its architecture
with its distribution, and a tiny SmolLM3 checkpoint built from transformers' own
SmolLM3Config and saved with `save_pretrained` serves transformers' greedy tokens, its
NoPE layer included, in one process and over two tensor-parallel worker processes, and
with a sliding window on that layer; without a line of plugserve changed, and with the
package importing only what docs/models.md offers a model author.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from correctness.tiny_checkpoints import (
    FP32_TP_LOGPROB_TOLERANCE,
    TinyRun,
    hf_references,
    tensor_parallel_refusal,
    tiny,
    tokenizer_folder,
    write_tiny_checkpoint,
)
from transformers import AutoTokenizer, SmolLM3Config

from plugserve.model_files import model_architecture

PLUGSERVE = str(Path(sys.executable).with_name("plugserve"))
PACKAGE = Path(__file__).parent / "plugserve-smollm3" / "plugserve_smollm3"
# What a model package imports of plugserve (docs/models.md, "Adding an architecture").
MODEL_AUTHOR_SURFACE = (
    "plugserve",
    "plugserve.interfaces",
    "plugserve.model_files",
    "plugserve.worker.layers",
    "plugserve.worker.models.decoder",
    "plugserve.worker.parallel",
)
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than any scribe. Within fifty years "
    "printing shops had spread to more than two hundred cities across Europe, and the "
    "price of books fell so sharply that reading stopped being a privilege of monasteries "
    "and courts. Photosynthesis is the process by which green plants, algae and some "
    "bacteria convert light energy into chemical energy."
)


def smollm3_config(**overrides: Any) -> SmolLM3Config:
    """Three layers, the middle one NoPE (SmolLM3-3B: every fourth); biases on every
    projection; tied as SmolLM3-3B."""
    options = dict(
        num_hidden_layers=3,
        no_rope_layers=[1, 0, 1],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    )
    return SmolLM3Config(**tiny(**{**options, **overrides}))


@pytest.fixture(scope="module")
def tokenizer_files(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_folder(smollm2_path, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def prompts(smollm2_path: Path) -> list[list[int]]:
    """Short, and longer than a prefill chunk (CHUNK_TOKENS, 32)."""
    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(TEXT)
    return [ids[:5], ids[10:50], ids[20:95]]


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory, tokenizer_files: Path, prompts: list[list[int]]) -> TinyRun:
    folder = write_tiny_checkpoint(
        smollm3_config(), tmp_path_factory.mktemp("smollm3"), tokenizer_files
    )
    return TinyRun(str(folder), prompts, hf_references(folder, prompts))


def test_plugserve_models_lists_it_with_its_distribution() -> None:
    out = subprocess.run([PLUGSERVE, "models"], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("SmolLM3ForCausalLM"))
    assert line.split()[1:] == ["plugserve-smollm3", "plugserve_smollm3.model:SmolLM3ForCausalLM"]


def test_its_nope_layer_changes_what_transformers_writes(
    smollm3: TinyRun, tmp_path: Path, tokenizer_files: Path
) -> None:
    # The same weights (same seed and shapes) with every layer rotating write other
    # tokens: serving transformers' tokens below takes the NoPE layer wired as theirs.
    folder = write_tiny_checkpoint(
        smollm3_config(no_rope_layers=[1, 1, 1]), tmp_path, tokenizer_files
    )
    all_rotating = hf_references(folder, smollm3.prompts)
    assert [r.token_ids for r in all_rotating] != [r.token_ids for r in smollm3.references]


def test_it_serves_transformers_tokens_batched_and_one_at_a_time(smollm3: TinyRun) -> None:
    assert model_architecture(smollm3.model) == "SmolLM3ForCausalLM"  # nothing else registers it
    with smollm3.llm() as llm:
        smollm3.check(llm, batched=True)
        smollm3.check(llm, batched=False)


def test_it_serves_transformers_tokens_over_two_tensor_parallel_worker_processes(
    smollm3: TinyRun,
) -> None:
    # The workers find the package through its entry point too (each spawned process
    # loads the plugins again); the layers shard its heads, MLP and vocabulary.
    assert tensor_parallel_refusal(smollm3.model) is None
    with smollm3.tensor_parallel_llm() as llm:
        smollm3.check(llm, batched=True, tolerance=FP32_TP_LOGPROB_TOLERANCE)


def test_with_a_sliding_window_on_its_nope_layer_it_serves_transformers_tokens(
    tmp_path: Path, tokenizer_files: Path, prompts: list[list[int]]
) -> None:
    # A 12-token window that the 40- and 75-token prompts slide past, on layer 1.
    config = smollm3_config(use_sliding_window=True, sliding_window=12)
    assert config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    folder = write_tiny_checkpoint(config, tmp_path, tokenizer_files)
    windowed = TinyRun(str(folder), prompts, hf_references(folder, prompts))
    with windowed.llm() as llm:
        windowed.check(llm, batched=True)


def test_the_package_imports_only_the_model_authors_surface() -> None:
    imported = set()
    for file in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    ours = {m for m in imported if m.split(".")[0] == "plugserve"}
    assert ours, "the package imports nothing of plugserve?"
    outside = sorted(
        m for m in ours if not any(m == s or m.startswith(s + ".") for s in MODEL_AUTHOR_SURFACE)
    )
    assert outside == []
