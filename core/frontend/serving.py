"""Chat and text completions over the AsyncEngineClient: streamed (SSE) and not.

Each choice of a request (n > 1) is its own engine request; their deltas are merged as
they come. Validation happens here, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from plugserve.datatypes import Logprobs
from plugserve.frontend.constraints import check_tools, request_constraint
from plugserve.frontend.engine_client import AsyncEngineClient, RequestDelta
from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.logprobs import LogprobsFormatter, prompt_logprobs_entries
from plugserve.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    TokenizeRequest,
)
from plugserve.frontend.request_log import logged
from plugserve.frontend.tool_calls import AutoCalls, ChoiceOutput, NamedCall, RequiredCalls
from plugserve.generation_defaults import GenerationDefaults
from plugserve.interfaces import Renderer, StructuredOutputBackend, ToolParser
from plugserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["SSE_DONE", "InvalidRequest", "ModelNotFound", "OpenAIServing", "sse_event"]


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class _Prepared:
    """A validated request: prompts as token ids and the params for each."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    tokens_as_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Chat: how each choice's text becomes content and tool calls (tool_choice).
    make_output: Callable[[], ChoiceOutput] = ChoiceOutput

    @property
    def num_engine_requests(self) -> int:
        return len(self.prompts) * self.params.n

    def params_of(self, choice: int) -> SamplingParams:
        """Choice `choice` of a prompt: with a seed and n > 1, seed + choice (as vLLM),
        so the n samples differ and each is reproducible."""
        params = self.params
        if params.seed is None or params.n == 1 or choice == 0:
            return params
        return msgspec.structs.replace(params, seed=params.seed + choice)


def render_chat_request(
    renderer: Renderer, body: ChatCompletionRequest | TokenizeRequest
) -> list[int]:
    """A chat request's prompt ids (its messages, tools and template options), as the
    engine is sent them; a conversation the template refuses is a 400 on `messages`."""
    try:
        return renderer.render_chat(
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tool_dicts(),
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc), "messages") from exc


class OpenAIServing:
    def __init__(
        self,
        client: AsyncEngineClient,
        renderer: Renderer,
        model_name: str,
        *,
        structured_output_backend: type[StructuredOutputBackend] | None = None,
        tool_parser: type[ToolParser] | None = None,
        generation_defaults: GenerationDefaults | None = None,
        model_root: str | None = None,
        log_requests: bool = False,
    ) -> None:
        """`structured_output_backend`: the stack's backend class, whose `validate`
        checks constraints before they are queued (None: the engine reports them).
        `tool_parser`: the stack's parser class for `tool_choice: "auto"` (None: tool
        calls are not parsed from free text). `generation_defaults`: the model's
        sampling defaults and EOS ids (generation_config.json). `model_root`: the model
        as configured (/v1/models' `root`). `log_requests`: a line per finished request."""
        self.client = client
        self.renderer = renderer
        self.model_name = model_name
        self.model_root = model_root or model_name
        self.defaults = generation_defaults or GenerationDefaults()
        self.log_requests = log_requests
        self.tokenizer = renderer.tokenizer
        self.structured_output_backend = structured_output_backend
        self.tool_parser = tool_parser
        self._logprobs = LogprobsFormatter(renderer.tokenizer)

    @property
    def max_model_len(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.max_model_len

    # ------------------------------------------------------------------ validation

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ModelNotFound(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`."
            )

    def _params(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_len: int,
        constraint: Any = None,
    ) -> SamplingParams:
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} tokens, leaving no room to generate.",
                "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        max_tokens = body.requested_max_tokens
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}, but the prompt has {prompt_len} tokens and "
                f"this model's maximum context length is {self.max_model_len}.",
                "max_tokens",
            )
        vocab = len(self.tokenizer)
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(not 0 <= t < vocab for t in getattr(body, name) or []):
                raise InvalidRequest(f"{name} must be in [0, {vocab})", name)
        logit_bias = self._logit_bias(body.logit_bias, vocab)
        bad_words = self._bad_words(body.bad_words or [])
        try:
            params = body.sampling_params(
                max_tokens=max_tokens if max_tokens is not None else room,
                num_logprobs=body.num_logprobs,
                defaults=self.defaults.sampling,
                logit_bias=logit_bias,
                bad_words_token_ids=bad_words,
                structured_outputs=constraint,
                prompt_logprobs=getattr(body, "prompt_logprobs", None),
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self.defaults.with_eos(params)

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
        """OpenAI's keys are token ids written as strings."""
        if not bias:
            return None
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequest(
                    f"logit_bias keys are token ids; got {key!r}", "logit_bias"
                ) from None
            if not 0 <= token_id < vocab:
                raise InvalidRequest(
                    f"logit_bias: token id {token_id} is not in [0, {vocab})", "logit_bias"
                )
            out[token_id] = value
        return out

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would start the text and after a space (as vLLM
        does): a word is banned mid-sentence too, where its tokenization differs."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.renderer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _log_ignored(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        if logger.isEnabledFor(logging.DEBUG) and (ignored := body.ignored_fields()):
            logger.debug("request fields accepted and ignored: %s", ", ".join(ignored))

    def prepare_chat(self, body: ChatCompletionRequest, request_id: str | None = None) -> _Prepared:
        """`request_id`: the response's id (default: chatcmpl-<random>)."""
        self._check_model(body.model)
        self._log_ignored(body)
        check_tools(body)
        constraint = request_constraint(body, self.structured_output_backend)
        prompt = render_chat_request(self.renderer, body)
        params = self._params(body, len(prompt), constraint)
        return _Prepared(
            request_id or f"chatcmpl-{uuid.uuid4().hex}",
            [prompt],
            params,
            body.priority,
            body.return_tokens_as_token_ids,
            make_output=self._choice_output(body),
        )

    def _choice_output(self, body: ChatCompletionRequest) -> Callable[[], ChoiceOutput]:
        choice = body.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            return lambda: NamedCall(name)
        if choice == "required":
            return RequiredCalls
        if choice == "auto" and body.tools and self.tool_parser is not None:
            parser_cls, tools = self.tool_parser, body.tool_dicts() or []
            parallel = body.parallel_tool_calls
            return lambda: AutoCalls(
                parser_cls(tokenizer=self.tokenizer, tools=tools), parallel=parallel
            )
        return ChoiceOutput

    def prepare_completion(
        self, body: CompletionRequest, request_id: str | None = None
    ) -> _Prepared:
        """`request_id`: the response's id (default: cmpl-<random>)."""
        self._check_model(body.model)
        self._log_ignored(body)
        constraint = request_constraint(body, self.structured_output_backend)
        try:
            raw = body.prompts()
        except ValueError as exc:
            raise InvalidRequest(str(exc), "prompt") from exc
        vocab = len(self.tokenizer)
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(self.renderer.encode(p))
            elif any(not 0 <= t < vocab for t in p):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
            else:
                prompts.append(list(p))
        params = [self._params(body, len(p), constraint) for p in prompts]
        # max_tokens defaults per prompt to what fits; keep the smallest so one params
        # object serves all prompts.
        chosen = min(params, key=lambda sp: sp.max_tokens or 0)
        return _Prepared(
            request_id or f"cmpl-{uuid.uuid4().hex}",
            prompts,
            chosen,
            body.priority,
            body.return_tokens_as_token_ids,
        )

    # ------------------------------------------------------------------ running

    def run(self, prep: _Prepared) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Every choice of every prompt, merged as their deltas come: (choice index,
        delta); logged when done with `log_requests`."""
        if not self.log_requests:
            return self._merged(prep)
        num_prompt_tokens = sum(len(p) for p in prep.prompts)  # as usage counts them
        return logged(prep.request_id, num_prompt_tokens, self._merged(prep))

    async def _merged(self, prep: _Prepared) -> AsyncIterator[tuple[int, RequestDelta]]:
        n = prep.params.n
        # The response id may be the client's (X-Request-Id), which need not be unique;
        # the engines' ids must be.
        prefix = f"{prep.request_id}-{uuid.uuid4().hex[:8]}"
        streams = [
            (
                i * n + j,
                self.client.generate(
                    f"{prefix}-{i * n + j}",
                    ids,
                    prep.params_of(j),
                    priority=prep.priority,
                ),
            )
            for i, ids in enumerate(prep.prompts)
            for j in range(n)
        ]
        if len(streams) == 1:
            index, stream = streams[0]
            async for delta in stream:
                yield index, delta
            return
        queue: asyncio.Queue[tuple[int, RequestDelta] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestDelta]) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((index, delta))
            except BaseException as exc:  # surfaces in the consumer, which cancels the rest
                queue.put_nowait(exc)
                raise
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in streams]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, prep: _Prepared, chat: bool) -> dict[str, Any]:
        choices = [_Choice(i) for i in range(len(prep.prompts) * prep.params.n)]
        cached = 0
        async for index, delta in self.run(prep):
            choice = choices[index]
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=False))
            choice.num_output_tokens = delta.num_output_tokens
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            cached = max(cached, delta.num_cached_tokens)
        body = {
            "id": prep.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": prep.created,
            "model": self.model_name,
            "choices": [self._final_choice(c, chat, prep) for c in choices],
            "usage": self._usage(prep, sum(c.num_output_tokens for c in choices), cached),
        }
        return body

    def _final_choice(self, c: _Choice, chat: bool, prep: _Prepared) -> dict[str, Any]:
        text = "".join(c.text)
        logprobs = None
        if prep.params.logprobs is not None:
            logprobs = self._logprobs.format(c.logprobs, chat, prep.tokens_as_ids)
        if chat:
            content, tool_calls = prep.make_output().final(text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {
                "index": c.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(c.finish_reason, bool(tool_calls)),
                "stop_reason": c.stop_reason,
            }
        body = {
            "index": c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if prep.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(prep, c.index, c.prompt_logprobs)
        return body

    def _prompt_logprobs(
        self, prep: _Prepared, index: int, entries: list[Logprobs | None] | None
    ) -> list[Any] | None:
        if entries is None:  # the request ended before its first token
            return None
        prompt = prep.prompts[index // prep.params.n]
        return prompt_logprobs_entries(self._logprobs, prompt, entries, prep.tokens_as_ids)

    def _usage(self, prep: _Prepared, completion_tokens: int, cached: int) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prep.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def stream(
        self, prep: _Prepared, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per delta, [DONE] last."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {
            "id": prep.request_id,
            "object": kind,
            "created": prep.created,
            "model": self.model_name,
        }
        num_choices = len(prep.prompts) * prep.params.n
        num_output = [0] * num_choices
        outputs = [prep.make_output() for _ in range(num_choices)]
        cached = 0
        if chat:
            for i in range(num_choices):
                first = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield sse_event({**head, "choices": [first]})
        async for index, delta in self.run(prep):
            num_output[index] = delta.num_output_tokens
            cached = max(cached, delta.num_cached_tokens)
            if not (delta.text or delta.finished or delta.logprobs or delta.prompt_logprobs):
                continue  # nothing a client could show yet (held-back text)
            logprobs = None
            if prep.params.logprobs is not None and delta.logprobs:
                logprobs = self._logprobs.format(
                    list(zip(delta.token_ids, delta.logprobs, strict=False)),
                    chat,
                    prep.tokens_as_ids,
                )
            if not chat:
                choices: list[dict[str, Any]] = [{"index": index, "text": delta.text}]
                if delta.prompt_logprobs is not None:
                    choices[0]["prompt_logprobs"] = self._prompt_logprobs(
                        prep, index, delta.prompt_logprobs
                    )
            else:
                output = outputs[index]
                deltas = output.feed(delta.text)
                if delta.finished:
                    deltas += output.finish()
                elif not deltas and logprobs is None:
                    continue  # the text may open a tool call: held back for now
                choices = [{"index": index, "delta": d} for d in deltas or [{}]]
            for n_chunk, choice in enumerate(choices):
                choice["logprobs"] = logprobs if n_chunk == 0 else None
                choice["finish_reason"] = None
                if n_chunk == len(choices) - 1 and delta.finished:
                    called = chat and outputs[index].num_calls > 0
                    choice["finish_reason"] = _finish_reason(delta.finish_reason, called)
                    choice["stop_reason"] = delta.stop_reason
                chunk = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield sse_event(chunk)
        if include_usage:
            yield sse_event(
                {**head, "choices": [], "usage": self._usage(prep, sum(num_output), cached)}
            )
        yield SSE_DONE


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended with tool calls (not cut short) says so, as OpenAI's do."""
    return "tool_calls" if called and reason == "stop" else reason


SSE_DONE = b"data: [DONE]\n\n"

_json_encoder = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event; UTF-8 JSON as compact as json.dumps's, several times faster
    per streamed token."""
    return b"data: " + _json_encoder.encode(payload) + b"\n\n"
