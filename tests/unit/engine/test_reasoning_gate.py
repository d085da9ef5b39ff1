"""Specification of the engine's reasoning gate (SamplingParams.reasoning), on a tiny
random Qwen3 checkpoint whose thinking markers are special tokens, and on one where they
are plain text: a request's grammar applies from the token after the end marker, never to
the reasoning before it; and a thinking budget ends the reasoning by forcing the end
marker once that many reasoning tokens are out.

The random model never closes its reasoning by itself, so the budget is what ends it
here: the reasoning is the model's free text (which no JSON schema allows), the answer
is generated under the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from reasoning_checkpoint import write_reasoning_checkpoint

from plugserve import LLM, SamplingParams
from plugserve.sampling_params import ReasoningParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
BUDGET = 6


@pytest.fixture(scope="module", params=["special", "text"])
def llm(
    request: pytest.FixtureRequest, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LLM]:
    folder = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    write_reasoning_checkpoint(smollm2_path, folder, markers=request.param)
    engine = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory="16MiB",
        max_num_seqs=4,
        num_threads=1,
    )
    yield engine
    engine.engine.shutdown()


def prompt(llm: LLM) -> dict[str, Any]:
    ids = llm.renderer.render_chat([{"role": "user", "content": "Is 6 times 7 more than 40?"}])
    return {"prompt_token_ids": ids}


def end_ids(llm: LLM) -> list[int]:
    return llm.tokenizer.encode("</think>", add_special_tokens=False)


def reasoning(llm: LLM, budget: int) -> ReasoningParams:
    """As the API server's qwen3 parser describes its end marker to the engine: by its
    one id, or, where it is text, by its text too."""
    ids = end_ids(llm)
    return ReasoningParams(
        end_token_ids=ids, end_text=None if len(ids) == 1 else "</think>", budget=budget
    )


def split_at(token_ids: list[int], marker: list[int]) -> tuple[list[int], list[int]]:
    for i in range(len(token_ids) - len(marker) + 1):
        if token_ids[i : i + len(marker)] == marker:
            return token_ids[:i], token_ids[i + len(marker) :]
    raise AssertionError(f"no end marker {marker} in {token_ids}")


def test_a_grammar_constrains_only_the_answer_after_the_reasoning(llm: LLM) -> None:
    grammar = StructuredOutputsParams(json=json.dumps(SCHEMA))
    gated = SamplingParams(
        temperature=0,
        max_tokens=60,
        structured_outputs=grammar,
        reasoning=reasoning(llm, BUDGET),
    )
    output = llm.generate(prompt(llm), gated)[0].outputs[0]
    reasoning_ids, answer_ids = split_at(output.token_ids, end_ids(llm))
    # The reasoning is what the model writes with no grammar at all, which no schema
    # allows: the grammar neither masked nor saw it.
    free = SamplingParams(temperature=0, max_tokens=BUDGET, ignore_eos=True)
    assert reasoning_ids == llm.generate(prompt(llm), free)[0].outputs[0].token_ids
    with pytest.raises(json.JSONDecodeError):
        json.loads(llm.tokenizer.decode(reasoning_ids))
    assert json.loads(llm.tokenizer.decode(answer_ids, skip_special_tokens=True))["answer"] in (
        "yes",
        "no",
    )
    assert output.finish_reason == "stop"  # the grammar ended the answer
    # Without the gate the same grammar constrains the output from its first token.
    ungated = SamplingParams(temperature=0, max_tokens=60, structured_outputs=grammar)
    plain = llm.generate(prompt(llm), ungated)[0].outputs[0]
    assert json.loads(plain.text)["answer"] in ("yes", "no")


def test_the_thinking_budget_forces_the_end_marker(llm: LLM) -> None:
    marker = end_ids(llm)
    for budget in (1, BUDGET):
        params = SamplingParams(
            temperature=0,
            max_tokens=budget + len(marker) + 3,
            ignore_eos=True,
            reasoning=reasoning(llm, budget),
        )
        token_ids = llm.generate(prompt(llm), params)[0].outputs[0].token_ids
        reasoning_ids, answer_ids = split_at(token_ids, marker)
        assert len(reasoning_ids) == budget
        assert len(answer_ids) == 3  # the answer runs on after the forced marker
    free = SamplingParams(temperature=0, max_tokens=BUDGET + len(marker), ignore_eos=True)
    free_ids = llm.generate(prompt(llm), free)[0].outputs[0].token_ids
    assert free_ids[BUDGET:] != marker  # the model alone would not have closed it
