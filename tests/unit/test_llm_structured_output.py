"""Structured output end to end through the offline API, on the real SmolLM2 model, with
each bundled backend: the engine's grammar bitmask between execute_model and
sample_tokens, applied by the model runner to the constrained rows only. (Under tensor
parallelism: tests/unit/executors/test_mp.py.)

In one batch that mixes constrained requests (a JSON schema, a regex, a choice list) with
unconstrained ones, greedy and sampled (seeded): every constrained output is valid for
its constraint and ends with `stop`, and every unconstrained output equals the same
request's output in a run without the constrained ones.
"""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel, Field

from plugserve import LLM, SamplingParams
from plugserve.sampling_params import StructuredOutputsParams

ENGINE = dict(
    model="smollm2-135m-instruct", dtype="float32", kv_cache_memory="32MiB", max_num_seqs=8
)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["yes", "no"]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def constrained(**params) -> list[tuple[list[dict[str, str]], SamplingParams]]:
    """(conversation, params) of the constrained requests, with these sampling settings."""
    return [
        (
            chat("Describe a person as JSON."),
            SamplingParams(
                max_tokens=40,
                structured_outputs=StructuredOutputsParams(
                    json=json.dumps(Person.model_json_schema())
                ),
                **params,
            ),
        ),
        (
            chat("Write a phone number."),
            SamplingParams(
                max_tokens=24, structured_outputs=StructuredOutputsParams(regex=PHONE), **params
            ),
        ),
        (
            chat("Is water wet? Answer yes or no."),
            SamplingParams(
                max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES), **params
            ),
        ),
    ]


UNCONSTRAINED = [
    (chat("What is the capital of France?"), SamplingParams(temperature=0.0, max_tokens=12)),
    (chat("Tell me a story."), SamplingParams(temperature=0.8, seed=11, max_tokens=12)),
]
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, seed=5)


def assert_valid(texts: list[str], finish_reasons: list[str | None]) -> None:
    person, phone, choice = texts
    Person.model_validate_json(person)  # parses, and validates against the schema
    assert re.fullmatch(PHONE, phone), phone
    assert choice in CHOICES
    assert finish_reasons == ["stop"] * 3


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def llm(request):
    llm = LLM(structured_output=request.param, **ENGINE)
    yield llm
    llm.engine.shutdown()


_ALONE: list[list[int]] = []


@pytest.fixture
def alone(llm) -> list[list[int]]:
    """The unconstrained requests' tokens in a run of their own (run once: the backend
    plays no part in it)."""
    if not _ALONE:
        outputs = llm.chat([c for c, _ in UNCONSTRAINED], [p for _, p in UNCONSTRAINED])
        _ALONE.extend(o.outputs[0].token_ids for o in outputs)
    return _ALONE


def test_a_mixed_batch_keeps_every_constraint_and_leaves_the_rest_alone(llm, alone) -> None:
    requests = [*constrained(**GREEDY), *constrained(**SAMPLED), *UNCONSTRAINED]
    outputs = [o.outputs[0] for o in llm.chat([c for c, _ in requests], [p for _, p in requests])]
    assert_valid([o.text for o in outputs[:3]], [o.finish_reason for o in outputs[:3]])
    assert_valid([o.text for o in outputs[3:6]], [o.finish_reason for o in outputs[3:6]])
    assert [o.token_ids for o in outputs[6:]] == alone
    stats = llm.engine.stats()
    assert stats.grammar_bitmask_steps > 0 and stats.grammar_bitmask_seconds > 0
    assert not llm.engine.scheduler.requests


def test_a_bad_constraint_fails_its_request_with_the_problem_named(llm) -> None:
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(RuntimeError, match=r"structured output: invalid structured_outputs\.regex"):
        llm.generate("Hello", bad)
    assert not llm.engine.scheduler.requests
