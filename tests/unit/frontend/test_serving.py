"""How the serving layer turns a validated request into engine params, on the real
SmolLM2 tokenizer and no engine: token-level fields (logit_bias, allowed_token_ids,
bad_words), the n seeds, the ignored-field log, which output shaping tool_choice picks,
and how logprobs JSON cannot carry are rendered."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plugserve.datatypes import Logprobs
from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.logprobs import LogprobsFormatter, prompt_logprobs_entries
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.serving import ChatServing
from plugserve.frontend.routes.chat.tool_calls import (
    AutoCalls,
    ChoiceOutput,
    NamedCall,
    RequiredCalls,
)
from plugserve.frontend.routes.completions.protocol import CompletionRequest
from plugserve.frontend.routes.completions.serving import CompletionServing
from plugserve.frontend.serving import OpenAIServing
from plugserve.plugins import get_registry
from plugserve_plugins.text.hf_renderer import HFRenderer

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def serving(smollm2_path: Path) -> OpenAIServing:
    client: Any = SimpleNamespace(ready=SimpleNamespace(max_model_len=512))
    return OpenAIServing(
        client,
        HFRenderer(model_path=str(smollm2_path)),
        "m",
        tool_parser=get_registry().get("tool_parser", "hermes"),
    )


def completion(serving: OpenAIServing, **fields: Any):
    body = CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})
    return CompletionServing(serving).prepare(body)


def chat(serving: OpenAIServing, **fields: Any):
    messages = [{"role": "user", "content": "Hi"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
    return ChatServing(serving).prepare(body)


def test_bad_words_are_banned_as_written_and_after_a_space(serving):
    encode = serving.renderer.encode
    params = completion(serving, bad_words=["Paris", " Paris"]).params
    assert params.bad_words_token_ids == [
        encode("Paris", add_special_tokens=False),
        encode(" Paris", add_special_tokens=False),
    ]


def test_logit_bias_keys_are_token_ids_in_the_vocabulary(serving):
    assert completion(serving, logit_bias={"42": -100, "7": 5}).params.logit_bias == {
        42: -100.0,
        7: 5.0,
    }
    for bias, fragment in [({"Paris": 1}, "token ids"), ({"999999": 1}, "not in")]:
        with pytest.raises(InvalidRequest, match=fragment) as exc:
            completion(serving, logit_bias=bias)
        assert exc.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match=r"\[-100, 100\]"):
        completion(serving, logit_bias={"1": 101})


def test_allowed_token_ids_must_be_in_the_vocabulary(serving):
    assert completion(serving, allowed_token_ids=[1, 2]).params.allowed_token_ids == [1, 2]
    with pytest.raises(InvalidRequest) as exc:
        completion(serving, allowed_token_ids=[10**6])
    assert exc.value.param == "allowed_token_ids"


def test_n_choices_with_a_seed_sample_with_seed_plus_their_index(serving):
    prep = completion(serving, n=3, seed=7)
    assert [prep.params_of(j).seed for j in range(3)] == [7, 8, 9]
    unseeded = completion(serving, n=3)
    assert [unseeded.params_of(j).seed for j in range(3)] == [None] * 3


def test_ignored_fields_are_logged_by_name_at_debug_level(serving, caplog):
    with caplog.at_level(logging.DEBUG, logger="plugserve.frontend.serving"):
        completion(serving, user="u", metadata={"a": "b"})
        chat(serving)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["request fields accepted and ignored: user, metadata"]


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({}, ChoiceOutput),
        ({"tools": TOOLS, "tool_choice": "none"}, ChoiceOutput),
        ({"tools": TOOLS}, AutoCalls),
        ({"tools": TOOLS, "tool_choice": "required"}, RequiredCalls),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, NamedCall),
    ],
)  # fmt: skip
def test_tool_choice_picks_how_a_choice_is_answered(serving, fields, kind):
    prep = chat(serving, **fields)
    assert type(prep.make_output().answer) is kind
    forced = kind in (RequiredCalls, NamedCall)
    assert (prep.params.structured_outputs is not None) == forced


def test_logprobs_json_cannot_carry_are_rendered_as_vllm_renders_them():
    """-inf (a token a grammar or a bias ruled out), and any other non-finite value, is
    -9999.0 in all three shapes: chat's, completions', prompt_logprobs'."""
    tokenizer: Any = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    formatter = LogprobsFormatter(tokenizer)
    inf, nan = float("-inf"), float("nan")
    entry = Logprobs(nan, 1, [5, 6, 7], [-0.5, inf, float("inf")])
    chat_entry = formatter.chat([(5, entry)], tokens_as_ids=False)["content"][0]
    assert chat_entry["logprob"] == -9999.0
    assert [t["logprob"] for t in chat_entry["top_logprobs"]] == [-0.5, -9999.0, -9999.0]
    text = formatter.completion([(5, entry)], tokens_as_ids=False)
    assert text["token_logprobs"] == [-9999.0]
    assert text["top_logprobs"] == [{"<5>": -0.5, "<6>": -9999.0, "<7>": -9999.0}]
    [first, second] = prompt_logprobs_entries(formatter, [1, 5], [None, entry], False)
    assert first is None and {k: v["logprob"] for k, v in second.items()} == {
        "5": -9999.0,
        "6": -9999.0,
        "7": -9999.0,
    }


def test_a_thinking_budget_without_a_reasoning_parser_is_refused_by_name(serving):
    """The server has no reasoning parser: nothing could end a reasoning, so a budget
    for one is a 400 naming the field, on chat and on Anthropic's Messages API."""
    from plugserve.frontend.routes.messages.protocol import MessagesRequest
    from plugserve.frontend.routes.messages.serving import MessagesServing

    with pytest.raises(InvalidRequest) as chat_error:
        chat(serving, thinking_token_budget=8)
    assert chat_error.value.param == "thinking_token_budget"
    assert chat(serving).params.reasoning is None
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
    )
    with pytest.raises(InvalidRequest) as messages_error:
        MessagesServing(serving).prepare(body, "r")
    assert messages_error.value.param == "thinking"


def test_with_a_reasoning_parser_the_engine_is_told_where_the_reasoning_ends(serving):
    """SamplingParams.reasoning carries the end marker's ids (its tokenization here: the
    embedded tokenizer has no thinking tokens) and the budget, when the output starts in
    reasoning."""
    with_parser = OpenAIServing(
        serving.client,
        serving.renderer,
        "m",
        reasoning_parser=get_registry().get("reasoning_parser", "qwen3"),
    )
    params = chat(with_parser, thinking_token_budget=8).params
    assert params.reasoning is not None and params.reasoning.budget == 8
    marker = serving.renderer.encode("</think>", add_special_tokens=False)
    assert params.reasoning.end_token_ids == marker
    assert params.reasoning.end_text == "</think>"  # no token of its own: found as text


def test_anthropic_fields_with_no_effect_are_logged_by_name(serving, caplog):
    from plugserve.frontend.routes.messages.protocol import MessagesRequest
    from plugserve.frontend.routes.messages.serving import MessagesServing

    cached = {"type": "ephemeral"}
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": cached}],
            "messages": [{"role": "user", "content": "Hi"}],
            "metadata": {"user_id": "u"},
        }
    )
    logger = "plugserve.frontend.routes.messages.serving"
    with caplog.at_level(logging.DEBUG, logger=logger):
        MessagesServing(serving).prepare(body, "r")
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["request fields accepted and ignored: metadata, system.cache_control"]
