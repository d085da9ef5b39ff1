"""What every pooling endpoint shares (/v1/embeddings, /pooling, /classify, /score,
/rerank): the model must pool and serve the task, inputs become prompts (text, lists of
text, token ids, lists of token ids, (query, document) pairs), every prompt is checked
before anything is queued (empty, longer than the context or, for an encoder, than one
step's token budget) after truncate_prompt_tokens cut it as its tokenizer truncates
(prompt_truncation.py), then the prompts run as engine requests side by side and their
pooled outputs come back as arrays."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.serving import OpenAIServing
from plugserve.pooling_params import PoolingParams
from plugserve.prompt_truncation import PromptTruncation

# An input as OpenAI's embeddings take it: text, texts, token ids, lists of token ids.
PoolingInput = str | list[str] | list[int] | list[list[int]]


@dataclass
class PooledPrompts:
    """A pooling request ready for the engine: one prompt and its params per output."""

    prompts: list[list[int]]
    params: list[PoolingParams]

    @property
    def num_engine_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.setup = serving.pooling
        self.tokenizer = serving.tokenizer
        self.truncation = serving.prompt_truncation or PromptTruncation()

    def check(self, model: str | None, task: str, endpoint: str) -> None:
        """404 for another model; 400 where this model does not pool or serve `task`."""
        if model is not None:
            self.serving.check_model(model, generates=False)
        setup = self.setup
        if not setup.is_pooling:
            raise InvalidRequest(
                f"{endpoint} needs a pooling model; this model generates (serve a pooling "
                "model, or set engine.runner: pooling)",
                "model",
            )
        if task not in setup.tasks:
            raise InvalidRequest(
                f"{endpoint} needs a model that serves {task}; this model "
                f"({setup.architecture}) serves {', '.join(setup.tasks)}",
                "model",
            )

    def prompts(self, given: PoolingInput, param: str = "input") -> list[list[int]]:
        """Token ids of each prompt the input holds; 400 for an empty one."""
        if isinstance(given, str):
            texts: list[Any] = [given]
        elif not given:
            raise InvalidRequest(f"{param} is empty", param)
        elif all(isinstance(x, int) for x in given):
            texts = [list(given)]
        else:
            texts = list(given)
        prompts = []
        for item in texts:
            ids = self.serving.renderer.encode(item) if isinstance(item, str) else list(item)
            if not ids or (isinstance(item, str) and not item):
                raise InvalidRequest(f"{param} holds an empty prompt", param)
            prompts.append(ids)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for ids in prompts for t in ids):
            raise InvalidRequest(f"{param}: token ids must be in [0, {vocab})", param)
        return prompts

    def pair(
        self, query: str, document: str, truncate_prompt_tokens: int | None = None
    ) -> tuple[list[int], list[int] | None]:
        """A cross-encoder's prompt of one (query, document) pair, with the segment ids
        where the tokenizer gives them (BERT: 0 for the query, 1 for the document), cut
        by the tokenizer (longest text first) to `truncate_prompt_tokens` where given."""
        if truncate_prompt_tokens is None:
            encoded = self.tokenizer(query, document)
        else:
            try:
                self.truncation.check_pair(truncate_prompt_tokens)
            except ValueError as exc:
                raise InvalidRequest(str(exc), "truncate_prompt_tokens") from None
            encoded = self.tokenizer(
                query, document, truncation=True, max_length=truncate_prompt_tokens
            )
        segments = encoded.get("token_type_ids")
        if segments is not None and not any(segments):
            segments = None
        return list(encoded["input_ids"]), (list(segments) if segments else None)

    def prepare(
        self,
        prompts: list[list[int]],
        params: PoolingParams | list[PoolingParams],
        param: str = "input",
    ) -> PooledPrompts:
        """Check each prompt against the limits, truncating where the params ask."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        limit = self.serving.max_model_len
        budget = self.serving.max_num_batched_tokens
        checked = []
        for ids, p in zip(prompts, params_list, strict=True):
            if p.truncate_prompt_tokens is not None:
                if p.truncate_prompt_tokens > limit:
                    raise InvalidRequest(
                        f"truncate_prompt_tokens ({p.truncate_prompt_tokens}) is more than "
                        f"this model's maximum context length ({limit})",
                        "truncate_prompt_tokens",
                    )
                try:
                    ids = self.truncation.truncate(ids, p.truncate_prompt_tokens)
                except ValueError as exc:
                    raise InvalidRequest(str(exc), "truncate_prompt_tokens") from None
            if len(ids) > limit:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens; a prompt of "
                    f"{param} has {len(ids)} tokens (truncate_prompt_tokens cuts it)",
                    param,
                )
            if self.setup.is_encoder and budget is not None and len(ids) > budget:
                raise InvalidRequest(
                    f"a prompt of {param} has {len(ids)} tokens; an encoder runs each prompt "
                    f"in one step of at most max_num_batched_tokens ({budget}) tokens",
                    param,
                )
            checked.append(ids)
        return PooledPrompts(checked, params_list)

    def check_dimensions(self, dimensions: int | None) -> None:
        hidden_size = self.setup.hidden_size
        if dimensions is not None and not 1 <= dimensions <= hidden_size:
            raise InvalidRequest(
                f"dimensions must be in [1, {hidden_size}] for this model, got {dimensions}",
                "dimensions",
            )

    async def run(self, prepared: PooledPrompts) -> list[np.ndarray]:
        """The pooled output of every prompt, in order; the first failure cancels (and
        so aborts) the rest."""
        client = self.serving.client
        base = uuid.uuid4().hex
        tasks = [
            asyncio.ensure_future(client.encode(f"pool-{base}-{i}", ids, params))
            for i, (ids, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True))
        ]
        try:
            pooled = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [p.to_array() for p in pooled]


def usage(prepared: PooledPrompts) -> dict[str, int]:
    return {"prompt_tokens": prepared.num_tokens, "total_tokens": prepared.num_tokens}
