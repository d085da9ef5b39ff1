"""Specification of the bundled structured-output backends (the `structured_output` slot):
`xgrammar` and `llguidance`, on SmolLM2's real tokenizer.

Whatever the backend, a grammar's bitmask allows exactly the tokens whose text continues
the constraint (computed here independently, by decoding every token of the vocabulary),
never the ids past the tokenizer's vocabulary, and the stop tokens once the constraint is
complete; accepting the stop token terminates it. `validate` names the problem of a bad
constraint without a tokenizer. Compiled grammars are cached by the constraint.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from plugserve.interfaces.structured_output import Grammar, StructuredOutputBackend
from plugserve.plugins import get_registry
from plugserve.sampling_params import StructuredOutputsParams

BACKENDS = ("xgrammar", "llguidance")
EXTRA_IDS = 40  # the model's logits are wider than the tokenizer's vocabulary


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from plugserve.model_files import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def token_texts(tokenizer) -> list[str | None]:
    """Every token's text; None for special tokens (a grammar never allows them)."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [None if i in special else t for i, t in enumerate(texts)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer) -> StructuredOutputBackend:
    cls = get_registry().get("structured_output", request.param)
    return cls(
        tokenizer=tokenizer,
        vocab_size=len(tokenizer) + EXTRA_IDS,
        stop_token_ids=[tokenizer.eos_token_id],
    )


def allowed(grammar: Grammar, vocab_size: int) -> set[int]:
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((3, words), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert not bitmask[0].any() and not bitmask[2].any()  # only its own row written
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def texts_matching(token_texts: list[str | None], pattern: str) -> set[int]:
    regex = re.compile(pattern, re.DOTALL)
    return {i for i, t in enumerate(token_texts) if t and regex.fullmatch(t)}


def grammar_of(backend, spec: StructuredOutputsParams) -> Grammar:
    """A request's grammar, as the engine makes one: compile, then a grammar over it."""
    return backend.grammar(backend.compile(spec))


def accept_text(grammar: Grammar, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.accept_token(token), f"{tokenizer.decode([token])!r} rejected"


def test_both_backends_are_registered_and_match_the_protocol(backend) -> None:
    assert isinstance(backend, StructuredOutputBackend)
    assert set(BACKENDS) <= set(get_registry().implementations("structured_output"))


def test_choice_allows_exactly_the_prefixes_of_the_choices(backend, token_texts, tokenizer):
    choices = ["yes", "no", 'maybe "so"']
    grammar = grammar_of(backend, StructuredOutputsParams(choice=choices))
    expected = {i for i, t in enumerate(token_texts) if t and any(c.startswith(t) for c in choices)}
    assert allowed(grammar, backend.vocab_size) == expected
    accept_text(grammar, tokenizer, "maybe")
    # Mid-way, only continuations of the rest; llguidance may also drop a continuation
    # that no canonical tokenization would produce (a lone space before ' "').
    rest = allowed(grammar, backend.vocab_size)
    assert rest <= {i for i, t in enumerate(token_texts) if t and ' "so"'.startswith(t)}
    assert tokenizer.encode(' "so"', add_special_tokens=False)[0] in rest


def test_regex_allows_exactly_its_prefixes_then_the_stop_token(backend, token_texts, tokenizer):
    grammar = grammar_of(backend, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"))
    assert allowed(grammar, backend.vocab_size) == texts_matching(
        token_texts, r"[0-9]{1,3}|[0-9]{3}-[a-z]*"
    )
    accept_text(grammar, tokenizer, "123-ab")
    assert allowed(grammar, backend.vocab_size) == texts_matching(token_texts, r"[a-z]+") | {
        tokenizer.eos_token_id
    }
    assert not grammar.is_terminated()
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated()


def test_json_schema_accepts_a_valid_object_and_rejects_other_text(backend, tokenizer):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    spec = StructuredOutputsParams(json=json.dumps(schema))
    grammar = grammar_of(backend, spec)
    accept_text(grammar, tokenizer, '{"name": "Ada", "age": 36}')
    assert allowed(grammar, backend.vocab_size) == {tokenizer.eos_token_id}
    assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated()

    fresh = grammar_of(backend, spec)
    assert not fresh.accept_token(tokenizer.encode("Hello", add_special_tokens=False)[0])
    # An object missing a required key cannot close.
    partial = grammar_of(backend, spec)
    accept_text(partial, tokenizer, '{"name": "Ada"')
    assert tokenizer.encode("}", add_special_tokens=False)[0] not in allowed(
        partial, backend.vocab_size
    )
    # Nor admit keys the schema does not list (xgrammar's strict mode, on both backends).
    complete = grammar_of(backend, spec)
    accept_text(complete, tokenizer, '{"name": "Ada", "age": 36')
    assert tokenizer.encode(",", add_special_tokens=False)[0] not in allowed(
        complete, backend.vocab_size
    )


def test_json_object_starts_with_a_brace(backend, token_texts):
    grammar = grammar_of(backend, StructuredOutputsParams(json_object=True))
    assert allowed(grammar, backend.vocab_size) == texts_matching(token_texts, r"\{(\}|\"?)")


def test_ebnf_grammar(backend, token_texts, tokenizer):
    grammar = grammar_of(backend, StructuredOutputsParams(grammar='root ::= "x" ("y" | "z")*'))
    assert allowed(grammar, backend.vocab_size) == texts_matching(token_texts, r"x[yz]*")
    accept_text(grammar, tokenizer, "xyz")
    assert tokenizer.eos_token_id in allowed(grammar, backend.vocab_size)


def test_ids_past_the_tokenizer_are_never_allowed(backend, tokenizer):
    grammar = grammar_of(backend, StructuredOutputsParams(json_object=True))
    words = (backend.vocab_size + 31) // 32
    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    assert not bits[len(tokenizer) :].any()


def test_grammars_over_one_compiled_constraint_advance_each_on_its_own(backend, tokenizer):
    compiled = backend.compile(StructuredOutputsParams(regex=r"cached-[0-9]+"))
    first, second = backend.grammar(compiled), backend.grammar(compiled)
    accept_text(first, tokenizer, "cached-")
    # The second is still at the start, as is the compiled form a third would copy.
    assert not second.accept_token(tokenizer.encode("1", add_special_tokens=False)[0])
    accept_text(backend.grammar(compiled), tokenizer, "cached-1")


def test_rollback_undoes_accepted_tokens_a_stop_token_included(backend, token_texts, tokenizer):
    """What speculative decoding needs: check draft tokens, then undo them."""
    from plugserve.capabilities import supports_grammar_rollback

    grammar = grammar_of(backend, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+"))
    assert supports_grammar_rollback(grammar)
    accept_text(grammar, tokenizer, "12")
    at_12 = allowed(grammar, backend.vocab_size)
    accept_text(grammar, tokenizer, "3-ab")
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated()
    tokens_after_12 = len(tokenizer.encode("3-ab", add_special_tokens=False)) + 1
    grammar.rollback(tokens_after_12)
    assert not grammar.is_terminated()
    assert allowed(grammar, backend.vocab_size) == at_12
    accept_text(grammar, tokenizer, "3-x")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (dict(json="{not json"), "json: not JSON"),
        (dict(json="[1, 2]"), "json: a JSON schema is an object"),
        (dict(json='{"type": 3}'), "json"),
        (dict(regex="(abc"), "regex"),
        (dict(grammar="root ::= ("), "grammar"),
    ],
    ids=["json-syntax", "json-not-object", "json-bad-type", "regex", "ebnf"],
)
def test_validate_names_the_problem_without_a_tokenizer(name, spec, problem) -> None:
    cls = get_registry().get("structured_output", name)
    with pytest.raises(ValueError, match=rf"invalid structured_outputs\.{re.escape(problem)}"):
        cls.validate(StructuredOutputsParams(**spec))


@pytest.mark.parametrize("name", BACKENDS)
def test_validate_accepts_good_constraints(name) -> None:
    cls = get_registry().get("structured_output", name)
    for spec in (
        StructuredOutputsParams(
            json='{"type": "object", "properties": {"a": {"type": "integer"}}}'
        ),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\.com"),
        StructuredOutputsParams(choice=["a", "b"]),
        StructuredOutputsParams(grammar='root ::= "a" | "b"'),
    ):
        cls.validate(spec)


def test_compile_error_is_a_value_error(backend) -> None:
    with pytest.raises(ValueError, match=r"invalid structured_outputs\.regex"):
        backend.compile(StructuredOutputsParams(regex="(unclosed"))
