"""The serving layer the generating endpoints share (chat and text completions, and the
Responses API through chat), owned by none of them: the served model, its renderer and
generation defaults, the checks every request passes, how a request's fields become
SamplingParams, its engine requests (one per prompt and choice, merged as their deltas
come), and the parts of OpenAI's answer shape every completion has (id, usage, SSE
chunks). What an answer's choices look like is each endpoint's own (routes/<family>/).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from plugserve.datatypes import Logprobs, RequestDelta
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.logprobs import LogprobsFormatter
from plugserve.frontend.protocol import SamplingRequest
from plugserve.frontend.request_log import logged
from plugserve.generation_defaults import GenerationDefaults
from plugserve.interfaces.frontend import Renderer, ToolParser
from plugserve.interfaces.reasoning import ReasoningParser
from plugserve.interfaces.structured_output import StructuredOutputBackend
from plugserve.pooling_setup import PoolingSetup
from plugserve.prompt_truncation import PromptTruncation
from plugserve.sampling_params import ReasoningParams, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A validated request: prompts as token ids and the params for each."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    tokens_as_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

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


@dataclass
class CollectedChoice:
    """One choice of a non-streamed answer, its deltas put together."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None


class ChatPrompt(Protocol):
    """A body that carries a conversation to render: a chat completion's, a tokenize's."""

    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None

    def conversation(self) -> list[dict[str, Any]]: ...

    def tool_dicts(self) -> list[dict[str, Any]] | None: ...


def render_chat_request(renderer: Renderer, body: ChatPrompt) -> list[int]:
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
        reasoning_parser: type[ReasoningParser] | None = None,
        generation_defaults: GenerationDefaults | None = None,
        model_root: str | None = None,
        log_requests: bool = False,
        pooling: PoolingSetup | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """`structured_output_backend`: the stack's backend class, whose `validate`
        checks constraints before they are queued (None: the engine reports them).
        `tool_parser`: the stack's parser class for `tool_choice: "auto"` (None: tool
        calls are not parsed from free text). `reasoning_parser`: the stack's reasoning
        parser class (None: no output is reasoning). `generation_defaults`: the model's
        sampling defaults and EOS ids (generation_config.json). `model_root`: the model
        as configured (/v1/models' `root`). `log_requests`: a line per finished request.
        `pooling`: how the model is served (None: it generates); `max_num_batched_tokens`:
        the step's token budget, the longest prompt an encoder runs."""
        self.client = client
        self.renderer = renderer
        self.model_name = model_name
        self.model_root = model_root or model_name
        self.defaults = generation_defaults or GenerationDefaults()
        self.log_requests = log_requests
        self.tokenizer = renderer.tokenizer
        self.structured_output_backend = structured_output_backend
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.logprobs = LogprobsFormatter(renderer.tokenizer)
        self.pooling = pooling or PoolingSetup(runner="generate", architecture="")
        self.max_num_batched_tokens = max_num_batched_tokens
        # How truncate_prompt_tokens cuts a pooling prompt: read from the tokenizer once.
        self.prompt_truncation = (
            PromptTruncation.of_tokenizer(self.tokenizer) if self.pooling.is_pooling else None
        )

    @property
    def max_model_len(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.max_model_len

    # ------------------------------------------------------------------ validation

    def check_model(self, model: str, *, generates: bool = True) -> None:
        """404 for another model; 400 for a generating request to a pooling model."""
        if model != self.model_name:
            raise ModelNotFound(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`."
            )
        if generates:
            self.check_generates()

    def check_generates(self) -> None:
        if self.pooling.is_pooling:
            raise InvalidRequest(
                f"this model ({self.pooling.architecture}) is a pooling model and does not "
                f"generate: it serves {', '.join(self.pooling.tasks)} (/v1/embeddings, "
                "/pooling, /classify, /score, /rerank)",
                "model",
            )

    def log_ignored(self, body: SamplingRequest) -> None:
        if logger.isEnabledFor(logging.DEBUG) and (ignored := body.ignored_fields()):
            logger.debug("request fields accepted and ignored: %s", ", ".join(ignored))

    def sampling_params(
        self,
        body: SamplingRequest,
        prompt_len: int,
        *,
        prompt_param: str,
        constraint: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The params of a prompt of `prompt_len` tokens, checked against the context
        and the vocabulary; `prompt_param` is the field a prompt too long is blamed on."""
        self.check_generates()
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} tokens, leaving no room to generate.",
                prompt_param,
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
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self.defaults.with_eos(params)

    def reasoning_parser_factory(self, prompt: list[int]) -> Callable[[], ReasoningParser | None]:
        """A fresh reasoning parser per choice of `prompt` (None without one)."""
        cls = self.reasoning_parser
        if cls is None:
            return lambda: None
        tokenizer = self.tokenizer
        return lambda: cls(tokenizer=tokenizer, prompt_token_ids=prompt)

    def with_reasoning(
        self,
        params: SamplingParams,
        prompt: list[int],
        budget: int | None,
        *,
        budget_param: str = "thinking_token_budget",
    ) -> SamplingParams:
        """`params` telling the engine where the reasoning ends (and its thinking
        `budget`), when the output starts in reasoning. A budget needs a reasoning
        parser: without one it is a 400 naming `budget_param`."""
        cls = self.reasoning_parser
        if cls is None:
            if budget is not None:
                raise InvalidRequest(
                    f"{budget_param} needs a reasoning parser; this server has none "
                    "(stack.reasoning_parser)",
                    budget_param,
                )
            return params
        parser = cls(tokenizer=self.tokenizer, prompt_token_ids=prompt)
        if not parser.starts_in_reasoning:
            return params  # the prompt closed the thinking: nothing to gate or budget
        reasoning = ReasoningParams(
            end_token_ids=parser.end_token_ids, end_text=parser.end_text, budget=budget
        )
        return msgspec.structs.replace(params, reasoning=reasoning)

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

    # ------------------------------------------------------------------ running

    def run(self, prep: Prepared) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Every choice of every prompt, merged as their deltas come: (choice index,
        delta); logged when done with `log_requests`."""
        if not self.log_requests:
            return self._merged(prep)
        num_prompt_tokens = sum(len(p) for p in prep.prompts)  # as usage counts them
        return logged(prep.request_id, num_prompt_tokens, self._merged(prep))

    async def _merged(self, prep: Prepared) -> AsyncIterator[tuple[int, RequestDelta]]:
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

    # ------------------------------------------------------------------ answer shape

    async def collect(self, prep: Prepared) -> tuple[list[CollectedChoice], int]:
        """Every choice of a non-streamed answer, and the most prompt tokens any of them
        found cached."""
        choices = [CollectedChoice(i) for i in range(prep.num_engine_requests)]
        cached = 0
        async for index, delta in self.run(prep):
            choice = choices[index]
            choice.text.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=False))
            choice.num_output_tokens = delta.num_output_tokens
            choice.num_reasoning_tokens = delta.num_reasoning_tokens
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            cached = max(cached, delta.num_cached_tokens)
        return choices, cached

    def answer(
        self,
        prep: Prepared,
        object_name: str,
        choices: list[dict[str, Any]],
        num_output_tokens: int,
        cached: int,
    ) -> dict[str, Any]:
        """A non-streamed completion in OpenAI's shape: `object_name` and the endpoint's
        `choices` in the frame every completion shares."""
        return {
            "id": prep.request_id,
            "object": object_name,
            "created": prep.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(prep, num_output_tokens, cached),
        }

    def usage(
        self,
        prep: Prepared,
        completion_tokens: int,
        cached: int,
        reasoning_tokens: int | None = None,
    ) -> dict[str, Any]:
        """`reasoning_tokens`: with a reasoning parser, how many of the completion tokens
        were thinking (completion_tokens_details.reasoning_tokens)."""
        prompt_tokens = sum(len(p) for p in prep.prompts)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def chunks(
        self, prep: Prepared, object_name: str, include_usage: bool, *, reasoning: bool = False
    ) -> StreamedChunks:
        """`reasoning`: the usage reports reasoning tokens."""
        return StreamedChunks(self, prep, object_name, include_usage, reasoning=reasoning)


class StreamedChunks:
    """The server-sent chunks of one streamed completion: each carries the answer's id,
    object, created and model (and, with include_usage, a null usage); then the usage
    over every choice, then [DONE]."""

    def __init__(
        self,
        serving: OpenAIServing,
        prep: Prepared,
        object_name: str,
        include_usage: bool,
        *,
        reasoning: bool = False,
    ) -> None:
        self.serving = serving
        self.reasoning = reasoning
        self.prep = prep
        self.include_usage = include_usage
        self.head = {
            "id": prep.request_id,
            "object": object_name,
            "created": prep.created,
            "model": serving.model_name,
        }
        self._num_output = [0] * prep.num_engine_requests
        self._num_reasoning = [0] * prep.num_engine_requests
        self._cached = 0

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """The request's deltas (serving.run), counted for the usage at the end."""
        async for index, delta in self.serving.run(self.prep):
            self._num_output[index] = delta.num_output_tokens
            self._num_reasoning[index] = delta.num_reasoning_tokens
            self._cached = max(self._cached, delta.num_cached_tokens)
            yield index, delta

    def opening(self, choice: dict[str, Any]) -> bytes:
        """A chunk sent before any delta (chat's role), without the usage field."""
        return sse_event({**self.head, "choices": [choice]})

    def choices(
        self,
        choices: list[dict[str, Any]],
        delta: RequestDelta,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
    ) -> Iterator[bytes]:
        """One chunk per choice entry made of `delta`: the first carries its logprobs,
        the last, when the delta finished the choice, its `finish_reason`."""
        for n_chunk, choice in enumerate(choices):
            choice["logprobs"] = logprobs if n_chunk == 0 else None
            choice["finish_reason"] = None
            if n_chunk == len(choices) - 1 and delta.finished:
                choice["finish_reason"] = finish_reason
                choice["stop_reason"] = delta.stop_reason
            chunk = {**self.head, "choices": [choice]}
            if self.include_usage:
                chunk["usage"] = None
            yield sse_event(chunk)

    def end(self) -> Iterator[bytes]:
        if self.include_usage:
            reasoning = sum(self._num_reasoning) if self.reasoning else None
            usage = self.serving.usage(self.prep, sum(self._num_output), self._cached, reasoning)
            yield sse_event({**self.head, "choices": [], "usage": usage})
        yield SSE_DONE


def has_news(delta: RequestDelta) -> bool:
    """Whether a client could be shown anything of `delta` (text may be held back)."""
    return bool(delta.text or delta.finished or delta.logprobs or delta.prompt_logprobs)


SSE_DONE = b"data: [DONE]\n\n"

_json_encoder = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event; UTF-8 JSON as compact as json.dumps's, several times faster
    per streamed token."""
    return b"data: " + _json_encoder.encode(payload) + b"\n\n"
