"""Model resolution (plugserve.model_files): a Hugging Face folder, and a name nothing
resolves. The GGUF conversion is tests/unit/core/test_gguf_converter.py's; weight files,
architectures and Hub ids are test_model_sources.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugserve.model_files import resolve_model_path


def test_hf_folder_resolves_to_itself(smollm2_path: Path) -> None:
    assert resolve_model_path(str(smollm2_path)) == smollm2_path


def test_unknown_model_names_what_was_tried(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as excinfo:
        resolve_model_path("no-such-model")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "'no-such-model'" in message
    assert "smollm2-135m-instruct" in message
    assert ".gguf" in message
    assert "config.json" in message
    # A folder without config.json is not a model folder either.
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model_path(str(tmp_path))
