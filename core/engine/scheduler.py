"""The scheduler: a state machine stepped once per forward pass.

`schedule()` opens the pass (phases 5 and 6: which requests advance by how many tokens,
with their KV blocks allocated in the same decision); `update_from_output()` closes it
(phase 9: fold the sampled tokens back, finish requests, build outputs). Phases are
docs/request-path.md's.

One token budget per step is shared by decodes and chunked prefills. Running requests
are served first, in admission order; then waiting ones in the policy's order. When the
allocator runs dry, the policy picks a running request to preempt by recompute.

A request with a structured-output constraint first waits for its grammar
(WAITING_FOR_GRAMMAR, outside the policy's queue, so it holds up no one); it joins the
waiting queue once the grammar is compiled, or finishes with an error if it cannot be.
Each token it accepts advances its grammar; a grammar that reaches its end finishes the
request with `stop`.

With speculative decoding (speculation.py), a decoding request is scheduled with its
proposer's draft tokens after its next token, inside the same token budget; the drafts
it did not keep are taken back from `num_computed_tokens` when the pass returns.

A pooling request samples nothing: it finishes with `stop` in the step its last prompt
chunk runs, carrying the pooled output the runner returned, its blocks freed then
(pooling_scheduling.py says which prompts run whole and which skip the prefix cache).

With several batches in flight at once (pipeline stages, `max_concurrent_batches`), a
request in a batch that has not returned yet is neither scheduled nor preempted: its
next tokens depend on that batch's, and its blocks are in use. Each batch then takes at
most its share of the live requests (live / max_concurrent_batches, rounded up), so that
the requests spread over the batches and the stages have work at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from plugserve.datatypes import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from plugserve.engine.pooling_scheduling import PoolingScheduling
from plugserve.engine.reasoning_gate import ReasoningGate
from plugserve.engine.token_folding import append_until_stop, make_output
from plugserve.interfaces.kv_cache import KVAllocator
from plugserve.interfaces.scheduling import SchedulingPolicy
from plugserve.messages import EngineCoreOutput, SchedulerStats

if TYPE_CHECKING:
    from plugserve.engine.speculation import Speculation
    from plugserve.engine.structured_output import StructuredOutputManager


class Scheduler:
    def __init__(
        self,
        *,
        policy: SchedulingPolicy,
        kv_allocator: KVAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        on_finished: Callable[[Request], None] | None = None,
        structured_output: StructuredOutputManager | None = None,
        speculation: Speculation | None = None,
        pooling: PoolingScheduling | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        self.policy = policy
        self.pooling = pooling
        self.max_concurrent_batches = max_concurrent_batches
        # Requests in a batch the executor has not returned (mark_in_flight).
        self._in_flight: set[str] = set()
        self.kv = kv_allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.on_finished = on_finished  # observers (metrics, logging) of finished requests
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Rows the model runner must drop at the next step.
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (prefix-cache hits are not)
        self.num_finished: dict[str, int] = {}
        self.structured_output = structured_output
        # Constrained requests whose grammar is being compiled, in arrival order.
        self._waiting_for_grammar: list[Request] = []
        self._num_with_grammar = 0  # live requests holding a compiled grammar
        # Where each reasoning request's reasoning ends, and the thinking budgets.
        self.reasoning = ReasoningGate()
        # Outputs of requests finished by schedule() (a grammar that failed to compile),
        # handed out by the next update_from_output.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.speculation = speculation

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            if self.structured_output is None:
                raise ValueError("this engine has no structured-output backend")
            request.grammar_future = self.structured_output.submit(spec)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._waiting_for_grammar.append(request)
        else:
            # The policy first: a policy that refuses the request (raises) leaves no trace.
            self.policy.add(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (aborts); returns those that were live."""
        finished = [self.requests[rid] for rid in request_ids if rid in self.requests]
        if not finished:
            return []
        waiting = [
            r for r in finished if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        ]
        if waiting:
            self.policy.remove(waiting)
        compiling = {id(r) for r in finished if r.status == RequestStatus.WAITING_FOR_GRAMMAR}
        if compiling:
            for request in finished:
                if id(request) in compiling and request.grammar_future is not None:
                    request.grammar_future.cancel()
                    request.grammar_future = None
            self._waiting_for_grammar = [
                r for r in self._waiting_for_grammar if id(r) not in compiling
            ]
        gone = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in gone]
        for request in finished:
            request.status = status
            self._release(request)
        return finished

    def has_requests(self) -> bool:
        """Whether a step has work. Requests that finished wait for the next step to tell
        the runners they are gone: a step for that alone, as the engine goes idle, would
        cost a pass and a stats message at every request's end (what an idle engine's
        runners keep of them until then is a few rows)."""
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.policy) + len(self._waiting_for_grammar)

    # ------------------------------------------------------------------ grammars

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a pending grammar compilation ends or `timeout` passes: the engine
        calls it when nothing could be scheduled, instead of spinning."""
        futures = [r.grammar_future for r in self._waiting_for_grammar if r.grammar_future]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the waiting queue; those whose constraint
        failed to compile finish with an error. The others keep waiting."""
        still: list[Request] = []
        for request in self._waiting_for_grammar:
            future = request.grammar_future
            if future is not None and not future.done():
                still.append(request)
                continue
            request.grammar_future = None
            try:
                if future is None:
                    raise RuntimeError("its compilation was lost")
                request.grammar = future.result()
                request.status = RequestStatus.WAITING
                self.policy.add(request)
                self._num_with_grammar += 1
            except Exception as exc:
                request.grammar = None
                request.status = RequestStatus.FINISHED_ERROR
                request.error = f"structured output: {exc}"
                request.error_in_request = True
                self._release(request)
                self._pending_outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.status.finish_reason,
                        error=request.error,
                        error_in_request=True,
                    )
                )
        self._waiting_for_grammar = still

    def constrained_sampling(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The requests whose next token is constrained at this step: a grammar past the
        reasoning, or an end marker the thinking budget forces (a prefill chunk that does
        not reach the end of its tokens samples nothing and needs no bitmask row)."""
        if not self._num_with_grammar and not self.reasoning.num_forcing:
            return []
        requests = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.num_computed_tokens + num_tokens < request.num_tokens:
                continue
            if request.forced_token_ids or (
                request.grammar is not None and not request.in_reasoning
            ):
                requests.append(request)
        return requests

    # ------------------------------------------------------------------ batches in flight

    def mark_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """The batch went to the executor: its requests wait for it to return."""
        self._in_flight.update(scheduler_output.num_scheduled_tokens)

    def mark_returned(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's output is in (update_from_output follows)."""
        self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)

    def _batch_request_limit(self) -> int:
        if self.max_concurrent_batches == 1:
            return self.max_num_seqs
        live = len(self.running) + len(self.policy)
        return max(1, math.ceil(live / self.max_concurrent_batches))

    # ------------------------------------------------------------------ phase 5 + 6

    def schedule(self) -> SchedulerOutput:
        if self._waiting_for_grammar:
            self._admit_compiled()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        limit = self._batch_request_limit()

        # Running requests first: decodes, and prefills still being chunked.
        proposed = self.speculation.propose(self.running) if self.speculation else {}
        spec_tokens: dict[str, list[int]] = {}
        index = 0
        while index < len(self.running) and budget > 0 and len(num_scheduled) < limit:
            request = self.running[index]
            if request.request_id in self._in_flight:
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = proposed.get(request.request_id, [])[: budget - num_new]
            end = request.num_computed_tokens + num_new + len(draft)
            extra = self.speculation.lookahead(request, end) if self.speculation else 0
            new_blocks = None
            if draft or extra:
                new_blocks = self.kv.allocate_slots(request, num_new + len(draft) + extra)
            if new_blocks is None:  # without drafts: speculation never preempts anyone
                draft = []
                new_blocks = self._allocate_or_preempt(request, num_new, index)
                if new_blocks is None:  # the request itself gave way
                    continue
            if draft:
                spec_tokens[request.request_id] = draft
                num_new += len(draft)
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks)
            if self.speculation is not None:  # its table may have shrunk since (freed blocks)
                kept = len(self.kv.block_ids(request.request_id)) - len(new_blocks)
                cached.num_kept_blocks.append(kept)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1
        preempted_now = bool(self._preempted_req_ids)

        # Then waiting requests, unless this step already had to preempt.
        while (
            not preempted_now
            and budget > 0
            and len(self.policy) > 0
            and len(self.running) < self.max_num_seqs
            and len(num_scheduled) < limit
        ):
            request = self.policy.peek()
            if request.sampling_params.prompt_logprobs is None and (
                self.pooling is None or self.pooling.may_use_prefix_cache(request)
            ):
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            else:  # every prompt token's logits are needed: no prefix-cache hit (as vLLM)
                computed_blocks, num_hit = [], 0
            num_new = min(request.num_tokens - num_hit, budget)
            if self.pooling and not self.pooling.fits(request, num_new):
                break  # a bidirectional prompt runs whole: it waits for a step with room
            extra = (
                self.speculation.lookahead(request, num_hit + num_new) if self.speculation else 0
            )
            new_blocks = None
            if extra:
                new_blocks = self.kv.allocate_slots(
                    request, num_new + extra, computed_blocks, num_hit
                )
            if new_blocks is None:
                new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks, num_hit)
            if new_blocks is None:
                break  # head-of-line waits for blocks; admission order is the policy's
            self.policy.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self.running.append(request)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    pooling_params=request.pooling_params,
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        finished, preempted = self._finished_req_ids, self._preempted_req_ids
        self._finished_req_ids, self._preempted_req_ids = set(), set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens,
        )

    def _allocate_or_preempt(self, request: Request, num_new: int, index: int) -> list[int] | None:
        """Blocks for `request`, preempting running requests not yet scheduled this step
        and not in flight (the policy chooses) until they fit. None if `request` itself
        was preempted."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            candidates = [r for r in self.running[index:] if r.request_id not in self._in_flight]
            victim = self.policy.select_victim(candidates)
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if not request.output_token_ids:
            request.prompt_logprobs.clear()  # its prefill starts over
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_req_ids.add(request.request_id)
        self.policy.prepend(request)

    # ------------------------------------------------------------------ phase 9

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self._pending_outputs:
            outputs, self._pending_outputs = self._pending_outputs, []
        any_finished = False
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prompt_tokens += min(
                    num_tokens, request.num_prompt_tokens - request.num_computed_tokens
                )
            request.num_computed_tokens += num_tokens
            new_token_ids: list[int] = []
            if runner_output.prompt_logprobs:
                request.prompt_logprobs.extend(runner_output.prompt_logprobs.get(req_id, ()))
            error = runner_output.errors.get(req_id)
            if error is not None:
                request.status = RequestStatus.FINISHED_ERROR
                request.error = error
            elif request.pooling_params is not None:
                request.pooled = runner_output.pooled.get(req_id)
                if request.pooled is None:
                    continue  # a prompt chunk that is not the last: nothing pooled yet
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                sampled = runner_output.sampled_token_ids.get(req_id)
                if not sampled:
                    continue  # a prefill chunk that is not the last: nothing sampled yet
                draft = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
                if draft:
                    assert self.speculation is not None
                    request.num_computed_tokens -= self.speculation.accepted(
                        request, draft, len(sampled)
                    )
                new_token_ids = append_until_stop(
                    request, sampled, self.max_model_len, self.reasoning, self.structured_output
                )
                if self.speculation is not None and not request.is_finished:
                    self.speculation.free_unused_blocks(request, self.kv)
                self.num_generated_tokens += len(new_token_ids)
            any_finished |= request.is_finished
            outputs.append(make_output(request, new_token_ids, runner_output))
        if any_finished:
            for request in [r for r in self.running if r.is_finished]:
                self._release(request)
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        if request.grammar is not None:
            request.grammar = None
            self._num_with_grammar -= 1
        self.reasoning.release(request)
        del self.requests[request.request_id]
        self._preempted_req_ids.discard(request.request_id)
        self._finished_req_ids.add(request.request_id)
        if self.speculation is not None:
            self.speculation.request_finished(request.request_id)
        reason = request.status.finish_reason
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        if self.on_finished is not None:
            self.on_finished(request)

    # ------------------------------------------------------------------ stats

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        spec = self.speculation.stats if self.speculation is not None else None
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_finished=dict(self.num_finished),
            num_prompt_tokens=self.num_prompt_tokens,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos) if spec else [],
        )
