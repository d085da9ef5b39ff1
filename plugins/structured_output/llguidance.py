"""`llguidance`: a second bundled structured-output backend, on Microsoft's llguidance
engine (Rust; an Earley parser over a lazily built token trie, no ahead-of-time
compilation of the whole vocabulary).

The constraint becomes an llguidance grammar: a JSON schema, any JSON object (the schema
`{"type": "object"}`), a regex, an EBNF grammar (GBNF, converted to llguidance's Lark
dialect), or a choice list (a Lark alternation of the quoted strings). A pristine
LLMatcher per constraint key is cached; each request gets a deep copy of it.

JSON is generated compact by default, as with the xgrammar backend (`, ` and `: `
separators, no free whitespace); `plugins: {llguidance: {any_whitespace: true}}` allows
any. As with xgrammar (its strict mode), an object schema that lists properties and does not
say `additionalProperties` allows no other keys (`strict: false` follows JSON Schema's default instead). Once the
constraint is complete only the stop tokens are allowed, and the grammar terminates when
one is accepted: a constrained request ends with its stop token, as an unconstrained one.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from plugserve import hookimpl

if TYPE_CHECKING:
    import torch

    from plugserve.sampling_params import StructuredOutputsParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'


class LLGuidanceOptions(BaseModel):
    """`plugins: {llguidance: {...}}` in stack.yaml."""

    any_whitespace: bool = False  # JSON: allow any whitespace between tokens
    strict: bool = True  # JSON: objects allow no keys but their properties unless said


class LLGuidanceGrammar:
    """One request's matcher."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self._matcher.consume_token(token_id))
        self._ended = ok and token_id in self._stop_token_ids
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        # is_stopped() alone is already true when nothing but a stop token may follow.
        return self._ended and bool(self._matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)
            # Nothing follows an accepted stop token, so it was the last one undone.
            self._ended = False


class LLGuidanceBackend:
    Options = LLGuidanceOptions

    def __init__(
        self,
        *,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        options: LLGuidanceOptions | None = None,
    ) -> None:
        import llguidance
        import llguidance.hf

        self.options = options or LLGuidanceOptions()
        self.vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        # The first mask over a tokenizer builds llguidance's token trie (~2 s for a 49k
        # vocabulary): pay it here, on the engine's compile thread, not in a step.
        import torch
        from llguidance.torch import fill_next_token_bitmask

        warm = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_regex("a"))
        fill_next_token_bitmask(warm, torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32))

    @classmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        import llguidance

        grammar = _grammar(spec, any_whitespace=False, strict=True)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            kind, _ = spec.key
            raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(messages[0])}")

    def grammar(self, compiled: Any) -> LLGuidanceGrammar:
        # The cached matcher stays pristine: each request advances a copy.
        return LLGuidanceGrammar(compiled.deep_copy(), self._stop_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        grammar = _grammar(
            spec, any_whitespace=self.options.any_whitespace, strict=self.options.strict
        )
        # The constructor never raises for a bad grammar: the matcher enters an error state.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            kind, _ = spec.key
            raise ValueError(
                f"invalid structured_outputs.{kind}: {_first_line(matcher.get_error())}"
            )
        return matcher


def _grammar(spec: StructuredOutputsParams, *, any_whitespace: bool, strict: bool) -> str:
    """The llguidance grammar text for a constraint; ValueError if it cannot be built."""
    import llguidance

    kind, _ = spec.key
    try:
        if spec.json is not None or spec.json_object:
            schema = JSON_OBJECT_SCHEMA if spec.json_object else spec.json or ""
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc})") from exc
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            if strict:
                schema = json.dumps(_closed_objects(parsed))
            options: dict[str, Any] = (
                {"whitespace_flexible": True}
                if any_whitespace
                else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            )
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(exc)}") from exc


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists
    properties and does not say (xgrammar's strict mode; OpenAI's strict schemas require
    it). `{"type": "object"}` alone stays any object."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_objects(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


@hookimpl
def register_structured_output_backends(register):
    register("llguidance", LLGuidanceBackend)
