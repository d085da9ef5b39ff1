"""Structured output: a grammar compiled once, matched per request through a token bitmask."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from plugserve.sampling_params import StructuredOutputsParams


@runtime_checkable
class Grammar(Protocol):
    """One request's compiled constraint and where its output stands in it."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [rows, ceil(vocab/32)]
        bitmask (layout: datatypes.GrammarOutput)."""
        ...

    def is_terminated(self) -> bool:
        """The constraint is complete and a stop token was accepted after it: the request
        finishes with `stop`. (A complete constraint allows only the stop tokens.)"""
        ...


@runtime_checkable
class StructuredOutputBackend(Protocol):
    """Compiles structured-output constraints into Grammars for one tokenizer. Built once
    per engine process; `compile` runs on a worker thread, off the engine's loop, and the
    engine keeps what it returns (one cache for every backend)."""

    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size` is the model's logits width (it may exceed the tokenizer's)."""
        ...

    @classmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem (bad schema, regex, grammar) without a
        tokenizer: the API server calls it so a bad request gets a 400 before it queues."""
        ...

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The constraint compiled for this tokenizer: immutable, shared by every request
        with the same constraint (the engine caches it by `spec.key`); ValueError for a
        constraint this tokenizer cannot compile."""
        ...

    def grammar(self, compiled: Any) -> Grammar:
        """A fresh Grammar over a compiled constraint, for one request."""
        ...
