"""A chat choice's text as OpenAI's message and stream deltas, per tool_choice: what a
client gets non-streamed (content, tool_calls with ids) and streamed (a call's id, type
and name first, then its arguments), and that both agree."""

from __future__ import annotations

import json

import pytest

from plugserve.frontend.routes.chat.tool_calls import (
    AutoCalls,
    ChoiceOutput,
    NamedCall,
    RequiredCalls,
)
from plugserve.plugins import get_registry

ARGS = '{"city": "Paris, \\"FR\\" {x}"}'  # braces and quotes inside a string
REQUIRED_TEXT = (
    f'[{{"name": "get_weather", "parameters": {ARGS}}}, {{"name": "now", "parameters": {{}}}}]'
)


def stream(output: ChoiceOutput, text: str, piece: int) -> list[dict]:
    deltas = []
    for i in range(0, len(text), piece):
        deltas += output.feed(text[i : i + piece])
    return deltas + output.finish()


def merged_calls(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas merged by index, as the openai SDK's stream helpers do."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for item in delta.get("tool_calls", []):
            call = calls.setdefault(item["index"], {"arguments": ""})
            if "id" in item:
                assert "id" not in call, "a call's id comes once, in its first delta"
                call.update(id=item["id"], type=item["type"], name=item["function"]["name"])
            call["arguments"] += item["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_no_tools_the_text_is_the_content():
    assert ChoiceOutput().final("Hello") == ("Hello", [])
    assert stream(ChoiceOutput(), "Hello", 2) == [
        {"content": "He"},
        {"content": "ll"},
        {"content": "o"},
    ]


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_a_named_function_streams_its_arguments_as_generated(piece):
    content, [call] = NamedCall("get_weather").final(ARGS)
    assert content is None
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    deltas = stream(NamedCall("get_weather"), ARGS, piece)
    head = deltas[0]["tool_calls"][0]
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    [streamed] = merged_calls(deltas)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", ARGS)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_required_calls_are_streamed_as_each_closes(piece):
    content, calls = RequiredCalls().final(REQUIRED_TEXT)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", json.loads(ARGS)),
        ("now", {}),
    ]
    assert len({c["id"] for c in calls}) == 2
    streamed = merged_calls(stream(RequiredCalls(), REQUIRED_TEXT, piece))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        ("get_weather", json.loads(ARGS)),
        ("now", {}),
    ]


def test_required_cut_short_keeps_the_calls_that_closed():
    cut = REQUIRED_TEXT[: REQUIRED_TEXT.index('{"name": "now"') + 5]
    content, calls = RequiredCalls().final(cut)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert RequiredCalls().final('[{"na') == ('[{"na', [])


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_auto_uses_the_stacks_parser(piece):
    parser = get_registry().get("tool_parser", "hermes")
    text = f'Let me look.<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'
    content, [call] = AutoCalls(parser(tokenizer=None, tools=[])).final(text)
    assert content == "Let me look."
    assert json.loads(call["function"]["arguments"]) == json.loads(ARGS)
    output = AutoCalls(parser(tokenizer=None, tools=[]))
    deltas = stream(output, text, piece)
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    [streamed] = merged_calls(deltas)
    assert streamed["name"] == "get_weather" and output.num_calls == 1


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_auto_streams_no_whitespace_around_calls_as_content(piece):
    parser = get_registry().get("tool_parser", "hermes")
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    text = f"Checking.\n{call}\n{call}\n"
    deltas = stream(AutoCalls(parser(tokenizer=None, tools=[])), text, piece)
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert len(merged_calls(deltas)) == 2
    plain = "Line one.\n\nLine two.\n"  # without calls, the text is kept exactly
    deltas = stream(AutoCalls(parser(tokenizer=None, tools=[])), plain, piece)
    assert "".join(d.get("content", "") for d in deltas) == plain


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_auto_without_parallel_calls_answers_the_first_call_only(piece):
    parser = get_registry().get("tool_parser", "hermes")
    first = f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'
    text = f'{first}\n<tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>'
    _, calls = AutoCalls(parser(tokenizer=None, tools=[]), parallel=False).final(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    output = AutoCalls(parser(tokenizer=None, tools=[]), parallel=False)
    assert [c["name"] for c in merged_calls(stream(output, text, piece))] == ["get_weather"]
    _, both = AutoCalls(parser(tokenizer=None, tools=[])).final(text)
    assert len(both) == 2
