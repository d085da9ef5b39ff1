"""API-server side: rendering a conversation, detokenizing, finding tool calls, and the
handles an endpoint plugin gets (EngineClient, ApiServer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from plugserve.config import StackConfig
    from plugserve.datatypes import RequestDelta
    from plugserve.sampling_params import SamplingParams


@runtime_checkable
class Renderer(Protocol):
    """Conversation or text → prompt token ids (phase 1). Built once per process."""

    tokenizer: Any  # a transformers tokenizer; detokenizers are given it
    eos_token_id: int | None

    def __init__(self, *, model_path: str) -> None: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Apply the chat template and tokenize; raise ValueError for a malformed
        conversation. `messages` are OpenAI's (assistant turns may carry `tool_calls`
        with content None, `tool` turns a `tool_call_id`). `tools` (OpenAI's function
        tools) reach the template as transformers' `apply_chat_template(tools=...)`
        passes them. `continue_final_message`: the last message is the assistant's and
        stays open, for the model to continue (not with `add_generation_prompt`).
        `chat_template`: a template given with the request, instead of the model's."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


@runtime_checkable
class Detokenizer(Protocol):
    """Per-request, stateful: new token ids → new text (phase 11). Built once per request."""

    output_text: str
    stop_reason: str | None  # the stop string that matched, once one has

    def __init__(
        self, *, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def update(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they add. Checks stop strings on the new window only;
        after a match `stop_reason` is set and the text is cut as the params ask. Text
        that might still become a stop string is held back."""
        ...

    def flush(self) -> str:
        """The request ended for another reason (EOS, stop token, length, abort): return
        the held-back text; `output_text` is final afterwards."""
        ...


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A finished output split into the text meant for the user and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


@runtime_checkable
class ToolParser(Protocol):
    """Finds tool calls in the text of a model family's output (`tool_choice: "auto"`).
    Built once per request that offers tools, so it may keep streaming state."""

    def __init__(self, *, tokenizer: Any, tools: list[dict[str, Any]]) -> None: ...

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The whole output at once (non-streamed responses)."""
        ...

    def extract_tool_calls_streaming(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        """Streamed: feed the new text; returns (text to show as content now, calls
        completed by it). Text that may belong to a call is held back until it is known."""
        ...

    def finish_streaming(self) -> tuple[str, list[ToolCall]]:
        """Streamed: the output ended. Returns what was held back: text that turned out
        not to be a call, and a last call the model did not close."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """The API server's handle on its engines, as an endpoint plugin generates through it."""

    @property
    def is_dead(self) -> bool:
        """True once an engine has died: nothing more will be generated."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Submit one request (one sequence, whatever `params.n`) and yield its deltas
        until the one that finishes it; leaving the iteration early aborts it.
        `request_id` must be unique among the requests in flight. The engine's failure
        on this request raises in the iteration, as does a dead engine."""
        ...


@runtime_checkable
class ApiServer(Protocol):
    """One API-server process as `register_routes` shows it to a plugin: where its routes
    go, and what they serve with."""

    config: StackConfig  # the server's validated stack.yaml and overrides
    model_name: str  # as clients name it (server.served_model_name, else the model)
    renderer: Renderer  # the stack's renderer: the served tokenizer and chat template
    engine_client: EngineClient

    @property
    def max_model_len(self) -> int:
        """The context the engines were started with: prompt and output tokens together."""
        ...

    def include_router(self, router: Any) -> None:
        """Serve a `fastapi.APIRouter`'s routes from this API server. A method and path
        that another plugin or a bundled endpoint already serves is an error naming both."""
        ...
