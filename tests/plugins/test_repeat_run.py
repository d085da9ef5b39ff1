"""The out-of-tree example proposer (tests/plugins/plugserve-repeat-run), installed as a
third-party distribution: selected from stack.yaml, it speculates, and greedy output is
what it is without speculation."""

from __future__ import annotations

import gc

from plugserve import LLM, SamplingParams
from plugserve.worker.random_model import write_random_model


def test_selected_in_stack_yaml_it_lands_several_tokens_a_pass_and_changes_nothing(tmp_path):
    # Random weights with small spread: greedy output settles into runs of one token.
    model = write_random_model(tmp_path / "tiny", "tiny")
    config = tmp_path / "stack.yaml"
    engine = "engine: {max_num_seqs: 4, kv_cache_memory: 16MiB, dtype: float32}\n"
    config.write_text(
        "stack:\n  speculative: {proposer: repeat_run, num_tokens: 4}\n"
        f"plugins:\n  repeat_run: {{min_run: 2}}\n{engine}"
    )
    plain_config = tmp_path / "plain.yaml"
    plain_config.write_text(engine)
    prompts = [{"prompt_token_ids": list(range(100 + i, 120 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = {}
    for name, path in (("plain", plain_config), ("repeat_run", config)):
        llm = LLM(config=path, model=str(model))
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name == "repeat_run":
            stats = llm.engine.speculation.stats
            assert stats.num_accepted_tokens > stats.num_drafts > 0
        llm.engine.shutdown()
        del llm
        gc.collect()
    assert outputs["repeat_run"] == outputs["plain"]
