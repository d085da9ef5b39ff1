"""The reasoning gate: where a reasoning request's thinking ends, and its thinking budget.

A request whose sampling params carry a `reasoning` spec (the reasoning parser's end
marker, as token ids and, where the marker is plain text, as text; an optional budget)
starts in its reasoning: its grammar, if any, does not apply yet (the bitmask path and
the tool-call parser see the same boundary). The reasoning ends once the output ends with
the marker. With a budget reached, the marker's remaining ids are forced, one per step,
through the bitmask (a marker the model began writing is completed, not written twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve.datatypes import Request

if TYPE_CHECKING:
    from plugserve.engine.structured_output import StructuredOutputManager


class ReasoningGate:
    """The scheduler's reasoning bookkeeping."""

    def __init__(self) -> None:
        self.num_forcing = 0  # live requests whose thinking budget is forcing its end

    def advance(
        self,
        request: Request,
        token: int,
        structured_output: StructuredOutputManager | None,
    ) -> None:
        """`token` belongs to the reasoning. The reasoning ends once the output ends with
        the end marker; from the next token on, the grammar applies. With a thinking
        budget reached, the marker's remaining ids are forced, one per step.
        `structured_output` decodes a marker that is text."""
        reasoning = request.sampling_params.reasoning
        assert reasoning is not None
        request.num_reasoning_tokens += 1
        end = reasoning.end_token_ids
        if request.forced_token_ids:
            request.forced_token_ids.pop(0)
            if not request.forced_token_ids:
                self.num_forcing -= 1
        if _ended(request, reasoning.end_text, end, structured_output):
            request.in_reasoning = False
            if request.forced_token_ids:  # the model closed it on its own meanwhile
                request.forced_token_ids = []
                self.num_forcing -= 1
            return
        budget = reasoning.budget
        if (
            budget is not None
            and request.num_reasoning_tokens >= budget
            and not request.forced_token_ids
        ):
            request.forced_token_ids = end[partial_marker(request.output_token_ids, end) :]
            self.num_forcing += 1

    def release(self, request: Request) -> None:
        """`request` leaves the scheduler: it forces nothing any more."""
        if request.forced_token_ids:
            request.forced_token_ids = []
            self.num_forcing -= 1


def _ended(
    request: Request,
    end_text: str | None,
    end: list[int],
    structured_output: StructuredOutputManager | None,
) -> bool:
    """Whether the output's last token completed the end marker: its ids, or, for a
    marker that is text, its text in the output's last tokens (the marker was not there a
    token earlier, or the reasoning would have ended then)."""
    output = request.output_token_ids
    if end_text is None or structured_output is None:
        return output[-len(end) :] == end
    # Each token holds a character of the marker at least: its text fits in as many.
    window = output[-(len(end_text) + 1) :]
    return end_text in structured_output.decode(window)


def partial_marker(output_token_ids: list[int], end: list[int]) -> int:
    """How many leading ids of the end marker the output already ends with (a marker the
    model began writing is completed, not written twice)."""
    for length in range(min(len(end) - 1, len(output_token_ids)), 0, -1):
        if output_token_ids[-length:] == end[:length]:
            return length
    return 0
