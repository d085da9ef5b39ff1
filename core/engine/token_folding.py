"""Folding a step's sampled tokens into a request (phase 9): the stop checks, and the
output record the API server receives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve.datatypes import ModelRunnerOutput, Request, RequestStatus
from plugserve.engine.reasoning_gate import ReasoningGate
from plugserve.messages import EngineCoreOutput

if TYPE_CHECKING:
    from plugserve.engine.structured_output import StructuredOutputManager


def append_until_stop(
    request: Request,
    token_ids: list[int],
    max_model_len: int,
    reasoning: ReasoningGate,
    structured_output: StructuredOutputManager | None,
) -> list[int]:
    """Append sampled tokens to `request` one at a time, advancing its reasoning gate or
    grammar, until one finishes it (EOS, a stop token, max_tokens, the context, the
    grammar's end or its refusal): the tokens kept, which end with the finishing one."""
    params = request.sampling_params
    for i, token in enumerate(token_ids):
        request.append_output_token_ids([token])
        num_output = request.num_output_tokens
        grammar = request.grammar
        if request.in_reasoning:
            reasoning.advance(request, token, structured_output)
        elif grammar is not None:
            if not grammar.accept_token(token):
                request.status = RequestStatus.FINISHED_ERROR
                if request.grammar_dead_end:  # the request asked for the impossible
                    request.error = (
                        "structured output: no token of the model's vocabulary can "
                        f"continue the constraint after {num_output - 1} output tokens"
                    )
                    request.error_in_request = True
                else:
                    request.error = (
                        f"structured output: the grammar does not allow sampled token {token}"
                    )
                return token_ids[: i + 1]
            if grammar.is_terminated():
                request.status = RequestStatus.FINISHED_STOPPED
                return token_ids[: i + 1]
        if num_output >= params.min_tokens and (
            (token == request.eos_token_id and not params.ignore_eos)
            or token in params.stop_token_ids
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None if token == request.eos_token_id else token
        elif (params.max_tokens is not None and num_output >= params.max_tokens) or (
            request.num_tokens >= max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.is_finished:
            return token_ids[: i + 1]
    return token_ids


def make_output(
    request: Request, new_token_ids: list[int], runner_output: ModelRunnerOutput
) -> EngineCoreOutput:
    """The record of what a step added to `request`, for the API server."""
    logprobs = runner_output.logprobs.get(request.request_id)
    prompt_logprobs = None
    if (
        request.sampling_params.prompt_logprobs is not None
        and new_token_ids
        and request.num_output_tokens == len(new_token_ids)  # the first output
    ):
        prompt_logprobs = [None, *request.prompt_logprobs]
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        new_logprobs=logprobs[: len(new_token_ids)] if logprobs else None,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        error=request.error,
        prompt_logprobs=prompt_logprobs,
        error_in_request=request.error_in_request,
        num_reasoning_tokens=request.num_reasoning_tokens,
        pooled=request.pooled,
    )
