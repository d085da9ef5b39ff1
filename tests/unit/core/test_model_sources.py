"""The forms a model is named in beyond the built-in one: a Hugging Face Hub id found in
the local cache, a folder of sharded safetensors with their index; and a checkpoint of an
architecture no plugin registers, which fails at start in one line.

Nothing here downloads: HF_HUB_OFFLINE is set for every test (tests/conftest.py), and the
Hub cache is a folder of the test's own, laid out as huggingface_hub lays it out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from correctness.tiny_checkpoints import put_in_hub_cache, tiny
from safetensors.torch import save_file
from transformers import LlamaConfig

from plugserve import LLM, hookimpl
from plugserve.cli import main
from plugserve.model_files import (
    CheckpointError,
    UnsupportedModelError,
    check_architecture,
    resolve_model_path,
    safetensors_files,
)
from plugserve.plugins import PluginRegistry, set_registry
from plugserve.worker.model_loader import iter_weights
from plugserve.worker.random_model import TOKENIZER_FILES

PLUGSERVE = str(Path(sys.executable).parent / "plugserve")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache for this test (huggingface_hub read HF_HUB_CACHE at
    its import: the constant is what it consults)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def write_folder(folder: Path, architecture: str = "LlamaForCausalLM") -> Path:
    """A folder with a config.json naming `architecture` and one small weight file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


# --------------------------------------------------------------------------- Hub ids


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(
    tmp_path: Path, hub_cache: Path
) -> None:
    snapshot = put_in_hub_cache(write_folder(tmp_path / "src"), hub_cache, "tiny-org/tiny-lm")
    assert resolve_model_path("tiny-org/tiny-lm") == snapshot
    # The snapshot's files are symlinks into blobs/, read through as plain files.
    assert (snapshot / "model.safetensors").is_symlink()
    assert dict(iter_weights(snapshot))["w"].shape == (2,)


def test_a_hub_id_missing_from_the_cache_fails_in_one_line_without_downloading(
    hub_cache: Path,
) -> None:
    with pytest.raises(ValueError) as excinfo:
        resolve_model_path("tiny-org/absent")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "'tiny-org/absent' is not in the Hugging Face cache" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    assert "hf download tiny-org/absent" in message
    assert list(hub_cache.iterdir()) == []  # nothing fetched, nothing created


def test_a_snapshot_holding_only_a_config_is_incomplete_not_a_model(
    tmp_path: Path, hub_cache: Path
) -> None:
    # What AutoConfig.from_pretrained("owner/name") leaves behind.
    config_only = tmp_path / "src"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    put_in_hub_cache(config_only, hub_cache, "tiny-org/config-only")
    with pytest.raises(ValueError, match="'tiny-org/config-only' is only partly in"):
        resolve_model_path("tiny-org/config-only")


def test_an_existing_path_is_never_taken_for_a_hub_id(
    tmp_path: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_in_hub_cache(write_folder(tmp_path / "src"), hub_cache, "tiny-org/tiny-lm")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org" / "tiny-lm").mkdir(parents=True)  # a local folder, no config
    with pytest.raises(ValueError, match=r"folder holding config\.json"):
        resolve_model_path("tiny-org/tiny-lm")


# --------------------------------------------------------------------------- sharded folders


def test_an_index_decides_which_weight_files_load(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "sharded")
    (folder / "model.safetensors").unlink()
    save_file({"a": torch.ones(1)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(1)}, str(folder / "model-00002-of-00002.safetensors"))
    # A second copy of the weights under other names, as Mistral's repositories carry.
    save_file({"consolidated.a": torch.ones(1)}, str(folder / "consolidated.safetensors"))
    index = {
        "metadata": {"total_size": 8},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [f.name for f in safetensors_files(folder)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert sorted(name for name, _ in iter_weights(folder)) == ["a", "b"]

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"1 are missing .*model-00002-of-00002"):
        safetensors_files(folder)


# --------------------------------------------------------------------------- architectures


def test_an_unregistered_architecture_is_named_with_those_registered(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", "FooForCausalLM")
    assert check_architecture(write_folder(tmp_path / "ok"), ["LlamaForCausalLM"]) == (
        "LlamaForCausalLM"
    )
    with pytest.raises(UnsupportedModelError) as excinfo:
        check_architecture(folder, ["Qwen2ForCausalLM", "LlamaForCausalLM"])
    message = str(excinfo.value)
    assert "\n" not in message
    assert "'FooForCausalLM'" in message
    assert "LlamaForCausalLM, Qwen2ForCausalLM" in message


def test_llm_refuses_an_unregistered_architecture_before_building_an_engine(
    tmp_path: Path,
) -> None:
    folder = write_folder(tmp_path / "m", "FooForCausalLM")
    with pytest.raises(UnsupportedModelError, match=r"'FooForCausalLM'.*LlamaForCausalLM"):
        LLM(model=str(folder), dtype="float32")


def test_serve_refuses_an_unregistered_architecture_in_one_line(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", "FooForCausalLM")
    result = subprocess.run(
        [PLUGSERVE, "serve", "--model", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("plugserve: error: ")
    assert "'FooForCausalLM'" in result.stderr
    # Every built-in architecture is listed (in sorted order, the others between them).
    listed = result.stderr.split("registered architectures are ", 1)[1]
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert name in listed


def test_serve_reports_weights_that_do_not_fit_in_one_line(
    tmp_path: Path, smollm2_path: Path
) -> None:
    """A registered architecture whose checkpoint does not fit it fails in the engine,
    while loading: the API server reports the engine's one line and exits 1; neither
    process prints a traceback."""
    folder = write_folder(tmp_path / "m")  # a Llama config.json, one tensor 'w'
    config = LlamaConfig(
        **tiny(num_hidden_layers=1, max_position_embeddings=256),
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copyfile(smollm2_path / name, folder / name)
    result = subprocess.run(
        [PLUGSERVE, "serve", "--model", str(folder), "--port", "0", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    assert "checkpoint tensor 'w' has no place in LlamaForCausalLM" in errors[0]
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- plugserve models


def test_models_lists_each_architecture_with_its_distribution_without_importing_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    @hookimpl
    def register_models(register):
        register("TinyForCausalLM", "acme_tiny_models_probe:TinyForCausalLM")

    registry = PluginRegistry()
    registry.register(types.SimpleNamespace(register_models=register_models), "acme", "acme-models")
    previous = set_registry(registry)
    try:
        assert main(["models"]) == 0
    finally:
        set_registry(previous)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["architecture", "distribution", "class"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["LlamaForCausalLM"] == [
        "plugserve",
        "plugserve.worker.models.llama:LlamaForCausalLM",
    ]
    assert rows["Qwen2ForCausalLM"][0] == "plugserve"
    assert rows["TinyForCausalLM"] == ["acme-models", "acme_tiny_models_probe:TinyForCausalLM"]
    assert "acme_tiny_models_probe" not in sys.modules  # listed, never imported
