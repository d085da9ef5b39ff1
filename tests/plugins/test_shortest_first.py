"""The out-of-tree example plugin (tests/plugins/plugserve-shortest-first), installed as a
third-party distribution: found, listed, selected from stack.yaml, and obeyed — without a
line of plugserve changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from plugserve import LLM, SamplingParams
from plugserve.messages import EngineCoreRequest

PLUGSERVE = str(Path(sys.executable).with_name("plugserve"))


def test_plugserve_plugins_lists_it_with_its_distribution():
    out = subprocess.run([PLUGSERVE, "plugins"], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "shortest_first" in line)
    assert "plugserve-shortest-first" in line
    assert "plugserve_shortest_first.ShortestPromptFirst" in line


def test_selected_in_stack_yaml_it_orders_by_prompt_length_and_records_finishes(
    tmp_path, monkeypatch
):
    log = tmp_path / "finished.jsonl"
    monkeypatch.setenv("PLUGSERVE_FINISHED_LOG", str(log))
    config = tmp_path / "stack.yaml"
    config.write_text(
        "stack: {scheduler: shortest_first}\n"
        "engine: {max_num_seqs: 1, kv_cache_memory: 16MiB, dtype: float32}\n"
    )
    llm = LLM(config=config)
    engine = llm.engine
    lengths = {"long": 60, "short": 8, "medium": 30}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for request_id, n in lengths.items():
        engine.add_request(
            EngineCoreRequest(
                request_id=request_id, prompt_token_ids=[100] * n, sampling_params=params
            )
        )
    finish_order = []
    while engine.has_requests():
        outputs, _ = engine.step()
        finish_order += [o.request_id for o in outputs if o.finished]
    assert finish_order == ["short", "medium", "long"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["request_id"] for r in records] == finish_order
    assert all(r["finish_reason"] == "length" and r["num_output_tokens"] == 3 for r in records)
    assert {r["num_prompt_tokens"] for r in records} == set(lengths.values())
