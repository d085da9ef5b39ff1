"""Text completions over the shared serving layer: one or several prompts (text or
token ids), each choice's text as generated, with vLLM's prompt_logprobs; answered as a
`text_completion` or streamed as chunks of the same object."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from plugserve.datatypes import Logprobs, RequestDelta
from plugserve.frontend.constraints import request_constraint
from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.logprobs import prompt_logprobs_entries
from plugserve.frontend.routes.completions.protocol import CompletionRequest
from plugserve.frontend.serving import CollectedChoice, OpenAIServing, Prepared, has_news

OBJECT = "text_completion"  # of the answer and of each streamed chunk


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def prepare(self, body: CompletionRequest, request_id: str | None = None) -> Prepared:
        """`request_id`: the response's id (default: cmpl-<random>)."""
        serving = self.serving
        serving.check_model(body.model)
        serving.log_ignored(body)
        constraint = request_constraint(body, serving.structured_output_backend)
        prompts = self._prompt_ids(body)
        params = [
            serving.sampling_params(
                body,
                len(p),
                prompt_param="prompt",
                constraint=constraint,
                prompt_logprobs=body.prompt_logprobs,
            )
            for p in prompts
        ]
        # max_tokens defaults per prompt to what fits; keep the smallest so one params
        # object serves all prompts.
        chosen = min(params, key=lambda sp: sp.max_tokens or 0)
        return Prepared(
            request_id or f"cmpl-{uuid.uuid4().hex}",
            prompts,
            chosen,
            body.priority,
            body.return_tokens_as_token_ids,
        )

    def _prompt_ids(self, body: CompletionRequest) -> list[list[int]]:
        try:
            raw = body.prompts()
        except ValueError as exc:
            raise InvalidRequest(str(exc), "prompt") from exc
        vocab = len(self.serving.tokenizer)
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(self.serving.renderer.encode(p))
            elif any(not 0 <= t < vocab for t in p):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
            else:
                prompts.append(list(p))
        return prompts

    def _logprobs(self, prep: Prepared, entries: list[Any]) -> dict[str, Any] | None:
        if prep.params.logprobs is None:
            return None
        return self.serving.logprobs.completion(entries, prep.tokens_as_ids)

    def _prompt_logprobs(
        self, prep: Prepared, index: int, entries: list[Logprobs | None] | None
    ) -> list[Any] | None:
        if entries is None:  # the request ended before its first token
            return None
        prompt = prep.prompts[index // prep.params.n]
        return prompt_logprobs_entries(self.serving.logprobs, prompt, entries, prep.tokens_as_ids)

    async def complete(self, prep: Prepared) -> dict[str, Any]:
        choices, cached = await self.serving.collect(prep)
        num_output_tokens = sum(c.num_output_tokens for c in choices)
        shaped = [self._final_choice(c, prep) for c in choices]
        return self.serving.answer(prep, OBJECT, shaped, num_output_tokens, cached)

    def _final_choice(self, c: CollectedChoice, prep: Prepared) -> dict[str, Any]:
        body = {
            "index": c.index,
            "text": "".join(c.text),
            "logprobs": self._logprobs(prep, c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if prep.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(prep, c.index, c.prompt_logprobs)
        return body

    async def stream(self, prep: Prepared, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per delta, [DONE] last."""
        chunks = self.serving.chunks(prep, OBJECT, include_usage)
        async for index, delta in chunks.deltas():
            if not has_news(delta):
                continue
            choice: dict[str, Any] = {"index": index, "text": delta.text}
            if delta.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(
                    prep, index, delta.prompt_logprobs
                )
            logprobs = self._delta_logprobs(prep, delta)
            for chunk in chunks.choices([choice], delta, logprobs, delta.finish_reason):
                yield chunk
        for chunk in chunks.end():
            yield chunk

    def _delta_logprobs(self, prep: Prepared, delta: RequestDelta) -> dict[str, Any] | None:
        if not delta.logprobs:
            return None
        return self._logprobs(prep, list(zip(delta.token_ids, delta.logprobs, strict=False)))
