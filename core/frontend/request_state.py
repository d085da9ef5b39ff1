"""What the API server's engine client keeps per request in flight, and the errors a
request can end with on this side."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from plugserve.datatypes import RequestDelta
from plugserve.interfaces.frontend import Detokenizer
from plugserve.messages import EngineCoreOutput
from plugserve.output_text import detokenize_output
from plugserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more will be generated."""


class RequestError(RuntimeError):
    """The engine finished this request with an error; others are unaffected. `status`:
    400 when the error lies in the request (EngineCoreOutput.error_in_request), else 500."""

    def __init__(self, message: str, *, in_request: bool = False) -> None:
        super().__init__(message)
        self.status = 400 if in_request else 500
        self.error_type = "invalid_request_error" if in_request else "server_error"


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    # None for a pooling request, whose one output is the engine's own (with `pooled`).
    detokenizer: Detokenizer | None
    engine: int  # the data-parallel engine serving it
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    finished: bool = False

    def next_delta(self, output: EngineCoreOutput) -> tuple[RequestDelta, bool]:
        """One engine output of this generating request, detokenized into its delta; and
        whether a stop string ended the request here (the engine must then free it)."""
        assert self.detokenizer is not None
        self.num_output_tokens += len(output.new_token_ids)
        text = detokenize_output(self.detokenizer, self.params, output)
        delta = RequestDelta(
            text=text.text,
            token_ids=output.new_token_ids,
            logprobs=output.new_logprobs,
            finish_reason=text.finish_reason,
            stop_reason=text.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs=output.prompt_logprobs,
            num_reasoning_tokens=output.num_reasoning_tokens,
        )
        return delta, text.stopped_by_string
