"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`.

It runs the engine core in-process through the same plugins the server uses, plus the
renderer and detokenizer the API server would use.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugserve.config import StackConfig, load_config
from plugserve.engine.core import EngineCore
from plugserve.generation_defaults import GenerationDefaults
from plugserve.interfaces.frontend import Detokenizer, Renderer
from plugserve.messages import EngineCoreOutput, EngineCoreRequest
from plugserve.model_files import resolve_supported_model
from plugserve.output_text import detokenize_output
from plugserve.plugins import get_registry
from plugserve.pooling_params import PoolingParams
from plugserve.pooling_setup import check_pooling_stack
from plugserve.prompt_truncation import PromptTruncation
from plugserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # One dict per generated token: token id -> Logprob, the sampled token and the top-N.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token, token id -> Logprob (the
    # prompt's token and the top-N); None for the first token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


PromptInput = str | dict[str, Any]

# Everything but the transport: offline, the engine core runs in this process.
OFFLINE_SLOTS = (
    "renderer",
    "detokenizer",
    "scheduler",
    "kv_allocator",
    "structured_output",
    "executor",
    "attention",
    "linear_method",
    "spec_proposer",
)


@dataclass
class _Sequence:
    """One engine request: a prompt's n-th completion, with its own detokenizer."""

    output: CompletionOutput
    detokenizer: Detokenizer
    params: SamplingParams
    parent: RequestOutput
    tokens: list[int] = field(default_factory=list)


class LLM:
    """Generate offline. Overrides are stack.yaml keys by leaf name
    (`scheduler="priority"`, `max_num_batched_tokens=64`, `dtype="bfloat16"`) or dotted
    path; `config=` takes a StackConfig or a stack.yaml path."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: StackConfig | str | Path | None = None,
        **overrides: Any,
    ) -> None:
        if model is not None:
            overrides["model"] = model
        self.config = load_config(config, overrides, check_plugins=False)
        self.config.check_plugins(OFFLINE_SLOTS)
        registry = get_registry(self.config.disabled_plugins)
        # Before the engine: a checkpoint no plugin can run, or a stack that cannot serve
        # it, fails here in one line.
        model_path = str(
            resolve_supported_model(self.config.model, registry.implementations("model"))
        )
        check_pooling_stack(model_path, self.config)
        self.engine = EngineCore(self.config)
        stack = self.config.stack
        self.renderer: Renderer = registry.build(
            "renderer",
            stack.renderer,
            self.config.plugin_options(stack.renderer),
            model_path=model_path,
        )
        # Every EOS id of the model's generation_config.json stops, as in the API server.
        self._stops = GenerationDefaults.load(
            model_path, self.renderer.eos_token_id, use_sampling=False
        )
        self._detokenizer_cls = registry.get("detokenizer", stack.detokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given. A prompt is a string or
        {"prompt_token_ids": [...]} (optionally with "prompt")."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompt_ids = [self._tokenize(p) for p in prompts]
        return self._run(
            [p if isinstance(p, str) else p.get("prompt") for p in prompts],
            prompt_ids,
            sampling_params,
            priority,
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template applies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompt_ids = [
            self.renderer.render_chat(conv, add_generation_prompt=add_generation_prompt)
            for conv in conversations
        ]
        prompts = [self.tokenizer.decode(ids) for ids in prompt_ids]
        return self._run(prompts, prompt_ids, sampling_params, None)

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[np.ndarray]:
        """A pooling model's output per prompt, in the order given: an embedding
        [hidden] (or [tokens, hidden] for token_embed), or a classifier's probabilities
        [num_labels]. Raises ValueError naming what the engine refused."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        params_list = [params] * len(prompts) if isinstance(params, PoolingParams) else params
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} pooling params")
        ids = [str(next(self._ids)) for _ in prompts]
        results: dict[str, np.ndarray] = {}
        try:
            for request_id, prompt, param in zip(ids, prompts, params_list, strict=True):
                tokens = self._tokenize(prompt)
                if param.truncate_prompt_tokens is not None:
                    tokens = self._prompt_truncation.truncate(tokens, param.truncate_prompt_tokens)
                self.engine.add_request(
                    EngineCoreRequest(
                        request_id=request_id,
                        prompt_token_ids=tokens,
                        sampling_params=SamplingParams(max_tokens=1),
                        pooling_params=param,
                    )
                )
            while len(results) < len(ids):
                for out in self.engine.step()[0]:
                    if out.error is not None:
                        raise ValueError(f"request {out.request_id} failed: {out.error}")
                    if out.pooled is not None:
                        results[out.request_id] = out.pooled.to_array()
        finally:
            unfinished = [i for i in ids if i not in results]
            if unfinished:
                self.engine.abort_requests(unfinished)
        return [results[i] for i in ids]

    @functools.cached_property
    def _prompt_truncation(self) -> PromptTruncation:
        return PromptTruncation.of_tokenizer(self.tokenizer)

    def _tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return self.renderer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.renderer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt'")

    def _run(
        self,
        prompts: list[str | None],
        prompt_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_ids)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(params_list)} sampling params")
        if priority is not None and len(priority) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(priority)} priorities")

        results: list[RequestOutput] = []
        live: dict[str, _Sequence] = {}
        try:
            for i, (prompt, ids, params) in enumerate(
                zip(prompts, prompt_ids, params_list, strict=True)
            ):
                result = RequestOutput(str(next(self._ids)), prompt, ids, [])
                results.append(result)
                for index in range(params.n):
                    request_id = (
                        f"{result.request_id}-{index}" if params.n > 1 else result.request_id
                    )
                    self.engine.add_request(
                        EngineCoreRequest(
                            request_id=request_id,
                            prompt_token_ids=ids,
                            sampling_params=self._stops.with_eos(params),
                            eos_token_id=self.renderer.eos_token_id,
                            priority=priority[i] if priority is not None else 0,
                        )
                    )
                    output = CompletionOutput(index, "", [], None)
                    result.outputs.append(output)
                    live[request_id] = _Sequence(
                        output=output,
                        detokenizer=self._detokenizer_cls(
                            tokenizer=self.tokenizer, prompt_token_ids=ids, params=params
                        ),
                        params=params,
                        parent=result,
                    )
            while live:
                outputs, _ = self.engine.step()
                stopped = [o.request_id for o in outputs if self._apply(live[o.request_id], o)]
                for o in outputs:
                    if o.finished:
                        del live[o.request_id]
                for request_id in stopped:
                    # A stop string matched on our side: the engine must let go of it.
                    self.engine.abort_requests([request_id])
                    del live[request_id]
        finally:
            if live:
                self.engine.abort_requests(list(live))
        for result in results:
            result.finished = all(o.finished for o in result.outputs)
        return results

    def _apply(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Fold one engine output into its sequence; True if a stop string ended it."""
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
        output = seq.output
        output.token_ids.extend(out.new_token_ids)
        seq.parent.num_cached_tokens = out.num_cached_tokens
        delta = detokenize_output(seq.detokenizer, seq.params, out)
        output.text += delta.text
        if out.new_logprobs is not None:
            self._append_logprobs(output, out)
        if out.prompt_logprobs is not None and seq.parent.prompt_logprobs is None:
            seq.parent.prompt_logprobs = self._prompt_logprobs(seq.parent, out)
        if delta.finish_reason is not None:
            output.finish_reason, output.stop_reason = delta.finish_reason, delta.stop_reason
        stopped_by_string = delta.stopped_by_string
        return stopped_by_string

    def _prompt_logprobs(
        self, parent: RequestOutput, out: EngineCoreOutput
    ) -> list[dict[int, Logprob] | None]:
        decode = self.tokenizer.convert_ids_to_tokens
        result: list[dict[int, Logprob] | None] = []
        for token, lp in zip(parent.prompt_token_ids, out.prompt_logprobs or [], strict=False):
            if lp is None:
                result.append(None)
                continue
            entry = {token: Logprob(lp.sampled_logprob, lp.sampled_rank, decode(token))}
            for rank, (tid, tlp) in enumerate(
                zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1
            ):
                entry.setdefault(tid, Logprob(tlp, rank, decode(tid)))
            result.append(entry)
        return result

    def _append_logprobs(self, output: CompletionOutput, out: EngineCoreOutput) -> None:
        decode = self.tokenizer.convert_ids_to_tokens
        if output.logprobs is None:
            output.logprobs, output.cumulative_logprob = [], 0.0
        for token, lp in zip(out.new_token_ids, out.new_logprobs or [], strict=False):
            entry = {token: Logprob(lp.sampled_logprob, lp.sampled_rank, decode(token))}
            for rank, (tid, tlp) in enumerate(
                zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1
            ):
                entry.setdefault(tid, Logprob(tlp, rank, decode(tid)))
            output.logprobs.append(entry)
            output.cumulative_logprob = (output.cumulative_logprob or 0.0) + lp.sampled_logprob
