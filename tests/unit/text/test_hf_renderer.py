"""The `hf` renderer against the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugserve.interfaces.frontend import Renderer
from plugserve_plugins.text.hf_renderer import HFRenderer, register_renderers

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def renderer(smollm2_path: Path) -> HFRenderer:
    return HFRenderer(model_path=str(smollm2_path))


def test_is_a_renderer_and_registers_as_hf(renderer: HFRenderer) -> None:
    assert isinstance(renderer, Renderer)
    registered: dict[str, type] = {}
    register_renderers(register=registered.__setitem__)
    assert registered == {"hf": HFRenderer}


def test_eos_is_the_tokenizers(renderer: HFRenderer) -> None:
    assert renderer.eos_token_id is not None
    assert renderer.eos_token_id == renderer.tokenizer.eos_token_id


def test_chat_matches_apply_chat_template_and_ends_with_generation_prompt(
    renderer: HFRenderer,
) -> None:
    tokenizer = renderer.tokenizer
    ids = renderer.render_chat(CONVERSATION)

    expected = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert all(isinstance(i, int) for i in ids)

    header = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False
    ).removeprefix(tokenizer.apply_chat_template(CONVERSATION, tokenize=False))
    assert header.strip(), "the template should add an assistant header"
    assert ids[-len(tokenizer.encode(header, add_special_tokens=False)) :] == (
        tokenizer.encode(header, add_special_tokens=False)
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_without_generation_prompt_the_chat_ends_with_the_last_message(
    renderer: HFRenderer,
) -> None:
    with_prompt = renderer.render_chat(CONVERSATION)
    without = renderer.render_chat(CONVERSATION, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    assert len(without) < len(with_prompt)
    assert renderer.tokenizer.decode(without).endswith("France?<|im_end|>\n")


def test_no_double_bos(renderer: HFRenderer) -> None:
    ids = renderer.render_chat(CONVERSATION)
    bos = renderer.tokenizer.bos_token_id
    assert bos is not None
    assert ids[0] == bos
    assert ids[1] != bos
    assert renderer.tokenizer.decode(ids).startswith("<|im_start|>system\n")


def test_no_double_bos_when_the_tokenizer_adds_one(
    renderer: HFRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = renderer.render_chat(CONVERSATION)
    # Many tokenizers prepend BOS on every encode; the template already wrote it.
    monkeypatch.setattr(renderer.tokenizer, "add_bos_token", True)
    bos = renderer.tokenizer.bos_token_id
    assert renderer.encode("Hi")[0] == bos, "the patched tokenizer should add BOS"
    assert renderer.render_chat(CONVERSATION) == expected


def test_default_system_prompt_comes_from_the_template(renderer: HFRenderer) -> None:
    text = renderer.tokenizer.decode(renderer.render_chat([{"role": "user", "content": "Hi"}]))
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" in text


def test_text_parts_are_joined_like_a_string(renderer: HFRenderer) -> None:
    parts = [
        {"role": "system", "content": "You are a terse assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        },
    ]
    as_string = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital\nof France?"},
    ]
    assert renderer.render_chat(parts) == renderer.render_chat(as_string)


def test_the_callers_messages_are_not_modified(renderer: HFRenderer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"}]
    renderer.render_chat(messages)
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"}
    ]


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ("Hello", "must be a list"),
        ({"role": "user", "content": "Hi"}, "must be a list"),
        ([], "at least one message"),
        (["Hi"], "messages[0] must be an object"),
        ([{"content": "Hi"}], "messages[0].role"),
        ([{"role": "", "content": "Hi"}], "messages[0].role"),
        ([{"role": 3, "content": "Hi"}], "messages[0].role"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
        ([{"role": "user", "content": ["Hi"]}], "messages[0].content[0] must be an object"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only 'text' parts",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "content[0].text"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "content[0].text"),
        (
            [{"role": "user", "content": "ok"}, {"role": "assistant", "content": {}}],
            "messages[1].content",
        ),
    ],
)
def test_malformed_conversations_raise_value_error(
    renderer: HFRenderer, messages: Any, fragment: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        renderer.render_chat(messages)
    assert fragment in str(excinfo.value)


def test_missing_chat_template_raises_value_error(
    renderer: HFRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(renderer.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        renderer.render_chat(CONVERSATION)


def test_a_template_that_rejects_the_conversation_raises_value_error(
    renderer: HFRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    monkeypatch.setattr(renderer.tokenizer, "chat_template", strict)
    with pytest.raises(ValueError, match="system messages are not supported"):
        renderer.render_chat(CONVERSATION)


def test_chat_template_kwargs_reach_the_template(
    renderer: HFRenderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix | default('') }}"
    monkeypatch.setattr(renderer.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "Hello"}]
    plain = renderer.render_chat(messages)
    with_suffix = renderer.render_chat(messages, chat_template_kwargs={"suffix": " world"})
    assert renderer.tokenizer.decode(plain) == "Hello"
    assert renderer.tokenizer.decode(with_suffix) == "Hello world"


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "chat_template", "conversation"])
def test_chat_template_kwargs_cannot_override_the_renderer(renderer: HFRenderer, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        renderer.render_chat(CONVERSATION, chat_template_kwargs={key: True})


def test_encode_matches_the_tokenizer(renderer: HFRenderer) -> None:
    text = "Hello, world! Ça va? 你好"
    tokenizer = renderer.tokenizer
    assert renderer.encode(text) == tokenizer.encode(text)
    assert renderer.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert renderer.tokenizer.decode(renderer.encode(text)) == text


def test_encode_rejects_non_strings(renderer: HFRenderer) -> None:
    with pytest.raises(ValueError, match="must be a string"):
        renderer.encode([1, 2, 3])  # type: ignore[arg-type]


# ----------------------------------------------------------------- tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Writes what a tool-aware template (Qwen's, Hermes') would: the tools, each call with
# its arguments as an object, and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def decode(renderer: HFRenderer, ids: list[int]) -> str:
    return renderer.tokenizer.decode(ids)


def test_tools_reach_the_template_as_apply_chat_template_passes_them(
    renderer: HFRenderer,
) -> None:
    ids = renderer.render_chat(CONVERSATION, tools=[WEATHER_TOOL], chat_template=TOOL_TEMPLATE)
    assert decode(renderer, ids).startswith("TOOLS:get_weather;|")
    expected = renderer.tokenizer.apply_chat_template(
        CONVERSATION, tools=[WEATHER_TOOL], chat_template=TOOL_TEMPLATE,
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert decode(renderer, ids) == expected


def test_assistant_tool_calls_and_tool_results_are_rendered(renderer: HFRenderer) -> None:
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    text = decode(renderer, renderer.render_chat(conversation, chat_template=TOOL_TEMPLATE))
    # The arguments arrive as an object (tojson writes it back), content null as "".
    assert '|assistant:<call>get_weather{"city": "Paris"}</call>|' in text
    assert "|tool:18 C, sunny[call_1]|" in text
    # The model's own template (no tool support) still renders the conversation.
    assert "18 C, sunny" in decode(renderer, renderer.render_chat(conversation))
    assert conversation[1]["content"] is None  # the request body is left as it was


def test_tool_call_arguments_must_be_json(renderer: HFRenderer) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls.*not JSON"):
        renderer.render_chat(messages)


def test_continue_final_message_leaves_the_assistant_turn_open(renderer: HFRenderer) -> None:
    conversation = [*CONVERSATION, {"role": "assistant", "content": "The capital is"}]
    ids = renderer.render_chat(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert decode(renderer, ids).endswith("<|im_start|>assistant\nThe capital is")
    closed = renderer.render_chat(conversation, add_generation_prompt=False)
    assert decode(renderer, closed).endswith("The capital is<|im_end|>\n")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, "add_generation_prompt"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "last message"),
    ],
)
def test_continue_final_message_needs_a_final_assistant_turn_and_no_generation_prompt(
    renderer: HFRenderer, kwargs: dict[str, bool], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        renderer.render_chat(CONVERSATION, **kwargs)


def test_a_request_chat_template_replaces_the_models(renderer: HFRenderer) -> None:
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    ids = renderer.render_chat(CONVERSATION, add_generation_prompt=False, chat_template=template)
    assert (
        decode(renderer, ids) == "<<You are a terse assistant.>><<What is the capital of France?>>"
    )
