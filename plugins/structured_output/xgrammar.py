"""`xgrammar`: the bundled default structured-output backend (the library vLLM and SGLang
default to).

Every kind of constraint becomes an xgrammar CompiledGrammar for the engine's tokenizer:
a JSON schema, any JSON object (the schema `{"type": "object"}`), a regex, an EBNF
grammar (xgrammar's GBNF dialect, root rule `root`), or a choice list (an EBNF
alternation of the quoted strings). Compiled grammars are cached by the constraint's
key; each request gets its own GrammarMatcher over the shared compiled form.

JSON is generated compact by default (`, ` and `: ` separators, no free whitespace):
with free whitespace a small model can fill its whole budget with newlines. Set
`plugins: {xgrammar: {any_whitespace: true}}` to allow any.

The model's logits may be wider than the tokenizer's vocabulary (padded embeddings):
the tokenizer info is built with the model's width, so the extra ids are never allowed.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from plugserve import hookimpl

if TYPE_CHECKING:
    import torch

    from plugserve.sampling_params import StructuredOutputsParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'
SEPARATORS = (", ", ": ")
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class XgrammarOptions(BaseModel):
    """`plugins: {xgrammar: {...}}` in stack.yaml."""

    any_whitespace: bool = False  # JSON: allow any whitespace between tokens
    max_threads: int = Field(2, ge=1)  # xgrammar's own threads per compilation


class XgrammarGrammar:
    """One request's matcher."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XgrammarBackend:
    Options = XgrammarOptions

    def __init__(
        self,
        *,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        options: XgrammarOptions | None = None,
    ) -> None:
        import xgrammar as xgr

        self.options = options or XgrammarOptions()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # The engine caches compiled constraints (by the constraint), not xgrammar.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=self.options.max_threads, cache_enabled=False
        )

    @classmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind, _ = spec.key
        try:
            if spec.json is not None:
                xgr.Grammar.from_json_schema(_json_schema(spec.json))
            elif spec.regex is not None:
                xgr.Grammar.from_regex(spec.regex)
            elif spec.grammar is not None:
                xgr.Grammar.from_ebnf(spec.grammar)
            elif spec.choice is not None:
                xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError and its own types
            raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(exc)}") from exc

    def grammar(self, compiled: Any) -> XgrammarGrammar:
        return XgrammarGrammar(compiled)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        kind, _ = spec.key
        try:
            if spec.json is not None or spec.json_object:
                schema = JSON_OBJECT_SCHEMA if spec.json_object else _json_schema(spec.json or "")
                if self.options.any_whitespace:
                    return self._compiler.compile_json_schema(schema, any_whitespace=True)
                return self._compiler.compile_json_schema(
                    schema, any_whitespace=False, separators=SEPARATORS
                )
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return self._compiler.compile_grammar(_choice_ebnf(spec.choice))
            return self._compiler.compile_grammar(spec.grammar or "")
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(exc)}") from exc


def _json_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid structured_outputs.json: not JSON ({exc})") from exc
    if not isinstance(schema, (dict, bool)):
        raise ValueError("invalid structured_outputs.json: a JSON schema is an object")
    return text


def _choice_ebnf(choices: list[str]) -> str:
    # A JSON string literal is also a valid xgrammar EBNF literal (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(exc: BaseException) -> str:
    """The message without xgrammar's "[time] file.cc:line: " prefix."""
    text = str(exc).strip() or type(exc).__name__
    return _SOURCE_PREFIX.sub("", text.splitlines()[0])


@hookimpl
def register_structured_output_backends(register):
    register("xgrammar", XgrammarBackend)
