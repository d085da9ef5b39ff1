"""Chat completions over the shared serving layer: a conversation rendered by the chat
template, each choice's text shaped into content and tool calls by `tool_choice`
(tool_calls.py), answered as a `chat.completion` or streamed as `chat.completion.chunk`s
that open with the assistant's role."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from plugserve.datatypes import RequestDelta
from plugserve.frontend.constraints import request_constraint
from plugserve.frontend.protocol import NamedToolChoice
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.chat.reasoning_output import ReasoningThenAnswer, reasoning_fields
from plugserve.frontend.routes.chat.tool_calls import (
    AutoCalls,
    ChoiceOutput,
    NamedCall,
    RequiredCalls,
)
from plugserve.frontend.routes.chat.tools import check_tools, forced_tool_schema
from plugserve.frontend.serving import (
    CollectedChoice,
    OpenAIServing,
    Prepared,
    has_news,
    render_chat_request,
)


@dataclass
class PreparedChat(Prepared):
    # How each choice's text becomes reasoning (the stack's reasoning parser), content
    # and tool calls (tool_choice).
    make_output: Callable[[], ReasoningThenAnswer] = lambda: ReasoningThenAnswer(
        ChoiceOutput(), None
    )
    # Whether usage reports reasoning tokens (a reasoning parser is configured).
    reports_reasoning: bool = False


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prepare(self, body: ChatCompletionRequest, request_id: str | None = None) -> PreparedChat:
        """`request_id`: the response's id (default: chatcmpl-<random>)."""
        serving = self.serving
        serving.check_model(body.model)
        serving.log_ignored(body)
        check_tools(body)
        constraint = request_constraint(
            body, serving.structured_output_backend, tool_schema=forced_tool_schema(body)
        )
        prompt = render_chat_request(serving.renderer, body)
        params = serving.sampling_params(
            body, len(prompt), prompt_param="messages", constraint=constraint
        )
        params = serving.with_reasoning(params, prompt, body.thinking_token_budget)
        make_answer = self._choice_output(body)
        make_parser = serving.reasoning_parser_factory(prompt)
        return PreparedChat(
            request_id or f"chatcmpl-{uuid.uuid4().hex}",
            [prompt],
            params,
            body.priority,
            body.return_tokens_as_token_ids,
            make_output=lambda: ReasoningThenAnswer(make_answer(), make_parser()),
            reports_reasoning=serving.reasoning_parser is not None,
        )

    def _choice_output(self, body: ChatCompletionRequest) -> Callable[[], ChoiceOutput]:
        choice = body.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            return lambda: NamedCall(name)
        if choice == "required":
            return RequiredCalls
        parser_cls = self.serving.tool_parser
        if choice == "auto" and body.tools and parser_cls is not None:
            tokenizer, tools = self.serving.tokenizer, body.tool_dicts() or []
            parallel = body.parallel_tool_calls
            return lambda: AutoCalls(
                parser_cls(tokenizer=tokenizer, tools=tools), parallel=parallel
            )
        return ChoiceOutput

    def _logprobs(self, prep: PreparedChat, entries: list[Any]) -> dict[str, Any] | None:
        if prep.params.logprobs is None:
            return None
        return self.serving.logprobs.chat(entries, prep.tokens_as_ids)

    async def complete(self, prep: PreparedChat) -> dict[str, Any]:
        choices, cached = await self.serving.collect(prep)
        num_output_tokens = sum(c.num_output_tokens for c in choices)
        shaped = [self._final_choice(c, prep) for c in choices]
        answer = self.serving.answer(prep, "chat.completion", shaped, num_output_tokens, cached)
        if prep.reports_reasoning:
            reasoning_tokens = sum(c.num_reasoning_tokens for c in choices)
            answer["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return answer

    def _final_choice(self, c: CollectedChoice, prep: PreparedChat) -> dict[str, Any]:
        output = prep.make_output()
        content, tool_calls = output.final("".join(c.text), c.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if output.reasoning is not None:
            message.update(reasoning_fields(output.reasoning))
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "index": c.index,
            "message": message,
            "logprobs": self._logprobs(prep, c.logprobs),
            "finish_reason": finish_reason(c.finish_reason, bool(tool_calls)),
            "stop_reason": c.stop_reason,
        }

    async def stream(self, prep: PreparedChat, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: the role first, then a chunk per content or tool-call
        delta, [DONE] last."""
        chunks = self.serving.chunks(
            prep, "chat.completion.chunk", include_usage, reasoning=prep.reports_reasoning
        )
        outputs = [prep.make_output() for _ in range(prep.num_engine_requests)]
        for i in range(prep.num_engine_requests):
            role = {"role": "assistant", "content": ""}
            yield chunks.opening(
                {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            )
        async for index, delta in chunks.deltas():
            # A special token the text leaves out (a reasoning marker) is news to the
            # reasoning parser all the same.
            if not has_news(delta) and not (prep.reports_reasoning and delta.token_ids):
                continue
            logprobs = self._delta_logprobs(prep, delta)
            output = outputs[index]
            deltas = output.feed(delta.text, delta.token_ids)
            if delta.finished:
                deltas += output.finish()
            elif not deltas and logprobs is None:
                continue  # the text may open a tool call: held back for now
            choices = [{"index": index, "delta": d} for d in deltas or [{}]]
            reason = finish_reason(delta.finish_reason, output.num_calls > 0)
            for chunk in chunks.choices(choices, delta, logprobs, reason):
                yield chunk
        for chunk in chunks.end():
            yield chunk

    def _delta_logprobs(self, prep: PreparedChat, delta: RequestDelta) -> dict[str, Any] | None:
        if not delta.logprobs:
            return None
        return self._logprobs(prep, list(zip(delta.token_ids, delta.logprobs, strict=False)))


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended with tool calls (not cut short) says so, as OpenAI's do."""
    return "tool_calls" if called and reason == "stop" else reason
