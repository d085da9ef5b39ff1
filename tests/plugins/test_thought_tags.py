"""The out-of-tree example reasoning parser (tests/plugins/plugserve-thought-tags),
installed as a third-party distribution: listed, selected from stack.yaml, and splitting
an output at its own markers, streamed or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from plugserve.config import load_config
from plugserve.interfaces.reasoning import ReasoningParser
from plugserve.plugins import get_registry

PLUGSERVE = str(Path(sys.executable).with_name("plugserve"))
OUTPUT = "<thought>Paris is the capital.</thought>\nParis."


def test_plugserve_plugins_lists_it_with_its_distribution() -> None:
    out = subprocess.run([PLUGSERVE, "plugins"], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "thought_tags" in line)
    assert "plugserve-thought-tags" in line
    assert "plugserve_thought_tags.ThoughtTagsParser" in line


def test_selected_in_stack_yaml_it_splits_at_its_markers(tmp_path: Path, smollm2_path) -> None:
    config = tmp_path / "stack.yaml"
    config.write_text("stack: {reasoning_parser: thought_tags}\n")
    stack = load_config(config, {}).stack
    cls = get_registry().get("reasoning_parser", stack.reasoning_parser)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    parser = cls(tokenizer=tokenizer, prompt_token_ids=prompt)
    assert isinstance(parser, ReasoningParser) and parser.starts_in_reasoning
    assert parser.end_token_ids == tokenizer.encode("</thought>", add_special_tokens=False)
    assert parser.extract_reasoning(OUTPUT, []) == ("Paris is the capital.", "Paris.")
    streamed = cls(tokenizer=tokenizer, prompt_token_ids=prompt)
    pieces = [streamed.extract_reasoning_streaming(ch, []) for ch in OUTPUT]
    pieces.append(streamed.finish_streaming())
    assert "".join(r for r, _ in pieces) == "Paris is the capital."
    assert "".join(a for _, a in pieces) == "Paris."
    closed = tokenizer.encode(
        "<|im_start|>assistant\n<thought></thought>", add_special_tokens=False
    )
    assert not cls(tokenizer=tokenizer, prompt_token_ids=closed).starts_in_reasoning
