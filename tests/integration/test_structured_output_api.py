"""Structured output, tool calling and the sampling fields beyond the basic ones, through
the official openai SDK against one live server (zmq): what a client asking for JSON, a
regex, a choice or a tool call gets back, and that no request field is silently
dropped.

Small outputs throughout (a few dozen tokens at most): the 135M model on one thread."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from plugserve.bench.plugserve_server import PlugserveServer

from .conftest import MODEL, assert_openai_error

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Capital(BaseModel):
    country: str
    capital: str


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str
    unit: str


class GetTime(BaseModel):
    """The local time in a city."""

    city: str


TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
SCHEMAS = {"GetWeather": GetWeather, "GetTime": GetTime}


@pytest.fixture(scope="module")
def server(zmq_server: PlugserveServer) -> PlugserveServer:
    # Every request here only reads the model: the shared default server serves them.
    return zmq_server


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from plugserve.model_files import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(MODEL)))


@pytest.fixture(scope="module")
def client(server: PlugserveServer) -> Iterator[openai.OpenAI]:
    with server.openai_client() as client:
        yield client


def post(server: PlugserveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=120)


def chat(client: openai.OpenAI, messages=QUESTION, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 40)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    """Each call has an id, names an offered function, and its arguments (JSON text)
    validate against that function's parameters."""
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """Merge delta.tool_calls by index (as the SDK's stream helpers do): the calls, the
    finish reason, and any content."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for item in choice.delta.tool_calls or []:
            call = calls.setdefault(item.index, {"arguments": ""})
            if item.id is not None:
                assert "id" not in call, "a call's id, type and name come once, first"
                assert item.type == "function" and item.function.arguments == ""
                call.update(id=item.id, name=item.function.name)
            else:
                assert "id" in call, "a call's first delta carries its id"
            call["arguments"] += item.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


# ------------------------------------------------------------------ structured output


def test_parse_with_a_pydantic_model_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Capital, max_tokens=60, temperature=0
    )
    [choice] = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital)


def test_json_object_output_parses_as_an_object(client):
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        result = chat(client, response_format={"type": "json_object"}, max_tokens=60, **kwargs)
        [choice] = result.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": PHONE}},
        {"guided_regex": PHONE},
        {"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
        {"guided_choice": ["Paris", "Lyon", "Nice"]},
    ],
    ids=["structured_outputs-regex", "guided_regex", "structured_outputs-choice", "guided_choice"],
)
def test_regex_and_choice_constrain_chat_and_completions(client, extra):
    chat_text = chat(client, extra_body=extra).choices[0].message.content
    completion = client.completions.create(
        model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0, extra_body=extra
    )
    for text in (chat_text, completion.choices[0].text):
        if "regex" in str(extra):
            assert re.fullmatch(PHONE, text), text
        else:
            assert text in ("Paris", "Lyon", "Nice")


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "response_format", "objekt"),
        ({"structured_outputs": {"regex": "([0-9]"}}, "structured_outputs", "regex"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
    ],
)  # fmt: skip
def test_an_invalid_constraint_is_a_400_naming_the_problem(server, body, param, fragment):
    response = post(server, "/v1/chat/completions", {"messages": QUESTION, **body})
    error = assert_openai_error(response, 400)
    assert error["param"] == param and fragment in error["message"], error


# ------------------------------------------------------------------ no silent ignores


def test_an_unknown_field_is_a_400_naming_it(server, client):
    response = post(server, "/v1/chat/completions", {"messages": QUESTION, "best_of": 2})
    error = assert_openai_error(response, 400)
    assert error["param"] == "best_of" and "best_of" in error["message"]
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, extra_body={"reasoning_effort": "high"})


def test_sdk_metadata_fields_are_accepted(client):
    result = chat(client, max_tokens=1, user="u-1", metadata={"run": "t"}, store=False)
    assert result.choices[0].finish_reason == "length"


# ------------------------------------------------------------------ tool calling


def test_tool_choice_required_returns_valid_calls(client):
    result = chat(
        client, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=80
    )
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_decides_whether_required_gives_more_than_one_call(
    client, tokenizer, parallel
):
    """The model is pushed to write call after call: every token with a "]" in it (the
    only tokens that can close the array of calls) gets a logit bias of -100. With
    parallel_tool_calls the array may go on, so the calls keep coming until max_tokens
    cuts the output (finish "length", some 30 tokens a call) and the calls that closed
    are returned, streamed or not. Without, the schema allows one call, after which the
    grammar leaves only "]" (a bias is not a mask): exactly one call, finished as a call."""
    closing = {str(i): -100 for i in range(len(tokenizer)) if "]" in tokenizer.decode([i])}
    kwargs = dict(
        messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=80,
        parallel_tool_calls=parallel, logit_bias=closing,
    )  # fmt: skip
    [choice] = chat(client, **kwargs).choices
    calls = choice.message.tool_calls
    assert_valid_calls(calls, set(SCHEMAS))
    if parallel:
        assert choice.finish_reason == "length" and len(calls) >= 2, calls
    else:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, calls
    streamed, finish, content = streamed_calls(chat(client, stream=True, **kwargs))
    assert (finish, content) == (choice.finish_reason, "")
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_named_tool_choice_returns_a_call_to_that_function(client):
    named = {"type": "function", "function": {"name": "GetWeather"}}
    result = chat(client, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=named)
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert_valid_calls([call], {"GetWeather"})


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "GetTime"}}]
)
def test_streamed_tool_calls_arrive_as_openai_sends_them(client, tool_choice):
    """At least one call arrives, valid against its function's parameters, and the stream
    carries the calls the non-streamed answer to the same (greedy) request holds."""
    kwargs = dict(messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=tool_choice, max_tokens=80)
    calls, finish, content = streamed_calls(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    assert calls, "no tool call arrived"
    for call in calls:
        SCHEMAS[call["name"]].model_validate_json(call["arguments"])
    whole = chat(client, **kwargs).choices[0].message.tool_calls
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls] == ["GetTime"]


# The Hermes format, forced by a regex so that the small model writes it; tool_choice
# "auto" leaves the output free, and the stack's parser (hermes) finds the call.
HERMES_CALL = '<tool_call>{"name": "GetTime", "arguments": {"city": "Paris"}}</tool_call>'


def test_auto_finds_the_call_the_model_writes_in_its_familys_format(client):
    regex = HERMES_CALL.replace("{", r"\{").replace("}", r"\}")  # no other regex syntax in it
    extra = {"structured_outputs": {"regex": regex}}
    result = chat(client, messages=WEATHER_QUESTION, tools=TOOLS, extra_body=extra, max_tokens=80)
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "GetTime",
        {"city": "Paris"},
    )
    assert choice.message.content is None
    stream = chat(
        client, messages=WEATHER_QUESTION, tools=TOOLS, extra_body=extra, max_tokens=80, stream=True
    )
    calls, finish, content = streamed_calls(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("GetTime", {"city": "Paris"})
    ]


def test_auto_without_a_call_is_plain_content(client):
    result = chat(client, tools=TOOLS, max_tokens=8)
    [choice] = result.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_a_conversation_with_tool_calls_and_results_is_the_models_template_of_it(client, tokenizer):
    """The prompt is transformers' apply_chat_template of the same messages and tools:
    its length is the usage's prompt_tokens, and the reply is the greedy completion of
    exactly those tokens."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "GetTime", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "It is 14:05 in Paris."},
    ]  # fmt: skip
    result = chat(client, messages=messages, tools=TOOLS, max_tokens=4)
    assert result.choices[0].finish_reason == "length"
    # Templates concatenate each message's content: a turn of calls only is given empty
    # content, as vLLM gives it.
    as_templated = [{**m, "content": m["content"] or ""} for m in messages]
    prompt = tokenizer.apply_chat_template(
        as_templated, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert result.usage.prompt_tokens == len(prompt)
    completion = client.completions.create(
        model=MODEL, prompt=list(prompt), max_tokens=4, temperature=0
    )
    assert result.choices[0].message.content == completion.choices[0].text


# ------------------------------------------------------------------ sampling fields


def greedy_token(client: openai.OpenAI, **extra: Any) -> tuple[int, str]:
    result = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **extra.pop("extra_body", {})}, **extra,
    )  # fmt: skip
    [token] = result.choices[0].logprobs.tokens
    return int(token.removeprefix("token_id:")), result.choices[0].text


def test_logit_bias_of_minus_100_on_the_greedy_token_changes_it(client):
    greedy, _ = greedy_token(client)
    biased, _ = greedy_token(client, logit_bias={str(greedy): -100})
    assert biased != greedy
    # +100 on another token makes it the greedy choice.
    assert greedy_token(client, logit_bias={"42": 100})[0] == 42


def test_allowed_token_ids_leave_only_those(client):
    greedy, _ = greedy_token(client)
    allowed = [11, 42]
    token, _ = greedy_token(client, extra_body={"allowed_token_ids": allowed})
    assert token in allowed and greedy not in allowed


def test_bad_words_ban_a_word_the_greedy_output_had(client):
    _, text = greedy_token(client)
    word = text.strip()
    assert word, text
    _, banned = greedy_token(client, extra_body={"bad_words": [word]})
    assert word not in banned


def greedy_ids(client: openai.OpenAI, prompt: str, max_tokens: int, **extra: Any) -> list[int]:
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **extra},
    )  # fmt: skip
    return [int(t.removeprefix("token_id:")) for t in result.choices[0].logprobs.tokens]


def starts(ids: list[int], sequence: list[int]) -> list[int]:
    """Where `sequence` occurs in `ids`."""
    return [i for i in range(len(ids)) if ids[i : i + len(sequence)] == sequence]


def test_bad_words_ban_a_multi_token_word_where_the_greedy_output_has_it(client, tokenizer):
    """Greedy, the story names its wizard "Elwes", three tokens, twice. Banned, that
    sequence never appears (neither as the text would start with it nor after a space):
    the output is the same up to the word's last token, which the ban replaces."""
    prompt, word = "Once upon a time, in a small village,", "Elwes"
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
    free = greedy_ids(client, prompt, 24)
    mid_sentence = sequences[1]
    assert len(mid_sentence) == 3 and len(starts(free, mid_sentence)) == 2, tokenizer.decode(free)
    banned = greedy_ids(client, prompt, 24, bad_words=[word])
    assert len(banned) == 24
    assert not any(starts(banned, sequence) for sequence in sequences), tokenizer.decode(banned)
    last = starts(free, mid_sentence)[0] + len(mid_sentence) - 1
    assert banned[:last] == free[:last] and banned[last] != free[last]


def test_n_with_a_seed_gives_distinct_reproducible_samples(client):
    def three() -> list[str]:
        result = chat(client, n=3, seed=7, temperature=1.0, max_tokens=12)
        return [c.message.content for c in sorted(result.choices, key=lambda c: c.index)]

    first = three()
    assert len(set(first)) == 3, first
    assert three() == first


def test_continue_final_message_continues_the_assistants_text(client, tokenizer):
    start = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": start}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    continued = chat(client, messages=messages, max_tokens=8, extra_body=extra)
    # What the model writes after the open assistant turn: the greedy completion of the
    # conversation rendered with that turn left unclosed.
    open_turn = tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(open_turn).endswith(start)
    completion = client.completions.create(
        model=MODEL, prompt=list(open_turn), max_tokens=8, temperature=0
    )
    assert continued.choices[0].message.content == completion.choices[0].text
    assert continued.usage.prompt_tokens == len(open_turn)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        chat(client, messages=messages, extra_body={"continue_final_message": True})


def test_a_request_chat_template_replaces_the_models(client):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    result = chat(client, max_tokens=1, extra_body={"chat_template": template})
    own = chat(client, max_tokens=1)
    plain = client.completions.create(
        model=MODEL, prompt=QUESTION[0]["content"], max_tokens=1, temperature=0
    )
    assert result.usage.prompt_tokens == plain.usage.prompt_tokens < own.usage.prompt_tokens


def test_prompt_logprobs_give_each_prompt_tokens_logprob_as_vllm(client, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    first = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    [token] = first.choices[0].logprobs.tokens
    greedy_id = int(token.removeprefix("token_id:"))
    # The prompt followed by its greedy token: that token's prompt logprob is the one it
    # was sampled with, at rank 1.
    result = client.completions.create(
        model=MODEL, prompt=(full := [*prompt, greedy_id]), max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    entries = result.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(full)
    assert entries[0] is None  # nothing comes before the first token
    for token_id, entry in zip(full[1:], entries[1:], strict=True):
        assert str(token_id) in entry  # the prompt's own token, then the top 2
        assert 2 <= len(entry) <= 3 and {1, 2} <= {v["rank"] for v in entry.values()}
        assert all(
            v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values()
        )
    last = entries[-1][str(greedy_id)]
    sampled = first.choices[0].logprobs.token_logprobs[0]
    assert last["rank"] == 1 and last["logprob"] == pytest.approx(sampled, abs=1e-3)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    with_prompt = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert len(with_prompt[0]) == len(prompt) and all(p is None for p in with_prompt[1:])
