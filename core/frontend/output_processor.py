"""The requests in flight on one API server, and what becomes of each engine output.

A request's state is registered before the request is sent, so no output can arrive for
an unknown one. Each output is detokenized into a delta on its request's own queue, stop
strings are checked here (the engine client sends those requests back as aborts), and an
error ends its request on this side. Pooling requests get their one output as it came.
"""

from __future__ import annotations

from typing import Any

from plugserve.frontend.engine_fleet import EngineFleet
from plugserve.frontend.metrics import FrontendMetrics
from plugserve.frontend.request_state import RequestError, RequestState
from plugserve.messages import EngineCoreOutput
from plugserve.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, fleet: EngineFleet, detokenizer_cls: Any) -> None:
        self.fleet = fleet
        self.detokenizer_cls = detokenizer_cls
        self.tokenizer: Any = None  # the renderer's, set before the first request
        self.metrics: FrontendMetrics | None = None  # set once the engines are ready
        self.states: dict[str, RequestState] = {}

    def open(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        detokenize: bool,
    ) -> RequestState:
        """A new request's state, on the least loaded serving engine."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = (
            self.detokenizer_cls(
                tokenizer=self.tokenizer, prompt_token_ids=prompt_token_ids, params=params
            )
            if detokenize
            else None
        )
        engine = self.fleet.pick()
        state = RequestState(request_id, len(prompt_token_ids), params, detokenizer, engine)
        self.states[request_id] = state
        self.fleet.load[engine] += 1
        if self.metrics is not None:
            self.metrics.request_started(request_id, engine, len(prompt_token_ids), arrival_time)
        return state

    def forget(self, state: RequestState, reason: str) -> None:
        """The request is over on this side (finished, failed or aborted), for `reason`
        (one of FINISH_REASONS)."""
        if not state.finished:
            state.finished = True
            del self.states[state.request_id]
            self.fleet.load[state.engine] -= 1
            if self.metrics is not None:
                self.metrics.request_finished(state.request_id, reason)

    def fail(self, error: BaseException, engine: int | None = None) -> None:
        """Every request in flight (on `engine`, where given) ends with `error`."""
        for state in [s for s in self.states.values() if engine in (None, s.engine)]:
            self.forget(state, "error")
            state.queue.put_nowait(error)

    def apply(self, output: EngineCoreOutput) -> bool:
        """One engine output onto its request's queue; True if a stop string ended the
        request here. An output for a request aborted meanwhile is dropped."""
        state = self.states.get(output.request_id)
        if state is None:
            return False
        if output.error is not None:
            self.forget(state, "error")
            state.queue.put_nowait(RequestError(output.error, in_request=output.error_in_request))
            return False
        if state.detokenizer is None:  # a pooling request: its one output
            self.forget(state, output.finish_reason or "stop")
            state.queue.put_nowait(output)
            return False
        if self.metrics is not None:
            self.metrics.request_output(state.request_id, output)
        delta, stopped_by_string = state.next_delta(output)
        if delta.finish_reason is not None and not stopped_by_string:
            self.forget(state, delta.finish_reason)
        state.queue.put_nowait(delta)
        return stopped_by_string
