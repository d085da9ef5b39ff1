"""The engine side of structured output: StructuredOutputManager and the scheduler's
WAITING_FOR_GRAMMAR state.

A real scheduler (paged allocator, fcfs policy) and a real manager whose backend is the
bundled xgrammar one, built from SmolLM2's tokenizer on the first constrained request.
The runner's part is played as in test_scheduler.py: every request that reaches the end
of its known tokens samples the token the test names. A backend registered by the test
holds its compilations until the test opens a gate, to show that a request whose grammar
is not ready holds up no one.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from plugserve import hookimpl
from plugserve.config import load_config
from plugserve.datatypes import ModelRunnerOutput, Request, RequestStatus
from plugserve.engine.scheduler import Scheduler
from plugserve.engine.structured_output import StructuredOutputManager
from plugserve.plugins import PluginRegistry
from plugserve.sampling_params import SamplingParams, StructuredOutputsParams
from plugserve_plugins.structured_output.xgrammar import XgrammarBackend

GATE = threading.Event()


class GatedBackend(XgrammarBackend):
    """xgrammar, each compilation held until GATE opens."""

    def compile(self, spec):
        assert GATE.wait(timeout=30)
        return super().compile(spec)


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    registry = PluginRegistry()
    plugin = types.SimpleNamespace(
        register_structured_output_backends=hookimpl(
            lambda register: register("gated", GatedBackend)
        )
    )
    registry.register(plugin, name="gated", distribution="tests-gated")
    return registry


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from plugserve.model_files import load_tokenizer

    return load_tokenizer(smollm2_path)


def make_manager(registry: PluginRegistry, backend: str) -> StructuredOutputManager:
    config = load_config(None, {"structured_output": backend}, check_plugins=False)
    return StructuredOutputManager(config, registry=registry)


@pytest.fixture(scope="module")
def xgrammar_manager(registry):
    manager = make_manager(registry, "xgrammar")
    yield manager
    manager.shutdown()


@pytest.fixture
def gated_manager(registry):
    GATE.clear()
    manager = make_manager(registry, "gated")
    yield manager
    GATE.set()
    manager.shutdown()


def make_scheduler(manager: StructuredOutputManager, budget: int = 64) -> Scheduler:
    registry = PluginRegistry()
    return Scheduler(
        policy=registry.build("scheduler", "fcfs"),
        kv_allocator=registry.build(
            "kv_allocator", "paged", num_blocks=64, block_size=4, enable_prefix_caching=False
        ),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=256,
        structured_output=manager,
    )


def request(rid: str, tokenizer, *, prompt_len: int = 6, **params) -> Request:
    params.setdefault("max_tokens", 8)
    prompt = list(range(1000, 1000 + prompt_len))
    return Request(rid, prompt, SamplingParams(**params), tokenizer.eos_token_id)


def run_step(scheduler: Scheduler, tokens: dict[str, int] | int = 7):
    out = scheduler.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = scheduler.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[rid] = [tokens if isinstance(tokens, int) else tokens[rid]]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out, {o.request_id: o for o in outputs}


def admit(scheduler: Scheduler) -> None:
    """Wait for every pending compilation (the engine waits in short slices instead)."""
    for r in list(scheduler._waiting_for_grammar):
        r.grammar_future.exception(timeout=30)


def only_token(tokenizer, text: str) -> int:
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_a_request_waiting_for_its_grammar_holds_up_no_one(gated_manager, tokenizer):
    scheduler = make_scheduler(gated_manager)
    scheduler.add_request(
        request("c", tokenizer, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    )
    scheduler.add_request(request("plain", tokenizer))
    for _ in range(3):
        out, _ = run_step(scheduler)
        assert list(out.num_scheduled_tokens) == ["plain"]
        assert scheduler.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.stats().num_waiting == 1

    GATE.set()
    admit(scheduler)
    out, outputs = run_step(scheduler, {"c": only_token(tokenizer, "abc"), "plain": 7})
    assert set(out.num_scheduled_tokens) == {"c", "plain"}
    assert outputs["c"].finish_reason is None
    assert scheduler.requests["c"].status == RequestStatus.RUNNING


def test_a_constraint_that_fails_to_compile_fails_only_its_request(xgrammar_manager, tokenizer):
    scheduler = make_scheduler(xgrammar_manager)
    scheduler.add_request(
        request("bad", tokenizer, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    )
    scheduler.add_request(request("plain", tokenizer, max_tokens=2))
    admit(scheduler)
    out, outputs = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == ["plain"]
    bad = outputs["bad"]
    assert bad.finish_reason == "error" and bad.new_token_ids == []
    assert "structured output: invalid structured_outputs.regex" in bad.error
    _, outputs = run_step(scheduler)
    assert outputs["plain"].finish_reason == "length"
    assert not scheduler.requests and scheduler.kv.stats().num_free_blocks == 64


def test_the_grammar_advances_with_each_token_and_its_end_finishes_with_stop(
    xgrammar_manager, tokenizer
):
    # ignore_eos: EOS alone would not end the request; the grammar's end does.
    spec = StructuredOutputsParams(choice=["yes", "no"])
    scheduler = make_scheduler(xgrammar_manager)
    scheduler.add_request(request("c", tokenizer, structured_outputs=spec, ignore_eos=True))
    admit(scheduler)
    yes, eos = only_token(tokenizer, "yes"), tokenizer.eos_token_id
    _, outputs = run_step(scheduler, yes)
    assert outputs["c"].finish_reason is None
    # Now the choice is complete: only the stop token may follow.
    [row] = xgrammar_manager.grammar_output([scheduler.requests["c"]]).bitmask_array()
    bits = ((torch.from_numpy(row.copy()).unsqueeze(-1) >> torch.arange(32)) & 1).flatten()
    assert bits.nonzero().flatten().tolist() == [eos]
    _, outputs = run_step(scheduler, eos)
    assert outputs["c"].finish_reason == "stop"
    assert outputs["c"].new_token_ids == [eos]
    assert not scheduler.requests


def test_a_token_the_grammar_does_not_allow_fails_the_request(xgrammar_manager, tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    scheduler = make_scheduler(xgrammar_manager)
    scheduler.add_request(request("c", tokenizer, structured_outputs=spec))
    admit(scheduler)
    _, outputs = run_step(scheduler, only_token(tokenizer, "maybe"))
    assert outputs["c"].finish_reason == "error"
    assert "does not allow" in outputs["c"].error
    assert not outputs["c"].error_in_request  # the mask would have kept it out: our error


def test_a_constraint_no_token_can_continue_fails_as_a_bad_request(xgrammar_manager, tokenizer):
    # xgrammar allows no token of SmolLM2's vocabulary for a character from U+40000 on.
    spec = StructuredOutputsParams(choice=["\U000a1234"])
    scheduler = make_scheduler(xgrammar_manager)
    scheduler.add_request(request("c", tokenizer, structured_outputs=spec))
    admit(scheduler)
    out = scheduler.schedule()
    grammar_output = xgrammar_manager.grammar_output(scheduler.constrained_sampling(out))
    assert not grammar_output.bitmask_array().any()
    sampled = ModelRunnerOutput(sampled_token_ids={"c": [7]})  # what an all -inf row yields
    [output] = scheduler.update_from_output(out, sampled)
    assert output.finish_reason == "error" and output.error_in_request
    assert "no token of the model's vocabulary can continue" in output.error


def test_only_constrained_requests_that_sample_get_a_bitmask_row(xgrammar_manager, tokenizer):
    spec = StructuredOutputsParams(regex="[a-z]+")
    scheduler = make_scheduler(xgrammar_manager, budget=8)
    scheduler.add_request(request("long", tokenizer, prompt_len=12, structured_outputs=spec))
    admit(scheduler)
    out = scheduler.schedule()  # 8 of long's 12 prompt tokens: a chunk that samples nothing
    assert out.num_scheduled_tokens == {"long": 8}
    assert scheduler.constrained_sampling(out) == []
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={}))
    scheduler.add_request(request("plain", tokenizer, prompt_len=2))
    out = scheduler.schedule()  # long's last 4 (it samples), and plain (no grammar)
    assert out.num_scheduled_tokens == {"long": 4, "plain": 2}
    assert [r.request_id for r in scheduler.constrained_sampling(out)] == ["long"]
    grammar_output = xgrammar_manager.grammar_output(scheduler.constrained_sampling(out))
    assert grammar_output.req_ids == ["long"]
    assert grammar_output.bitmask_array().shape == (1, (xgrammar_manager.vocab_size + 31) // 32)


def test_aborting_a_request_waiting_for_its_grammar(gated_manager, tokenizer):
    scheduler = make_scheduler(gated_manager)
    scheduler.add_request(
        request("c", tokenizer, structured_outputs=StructuredOutputsParams(regex="a"))
    )
    [aborted] = scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.requests and not scheduler._waiting_for_grammar
    assert scheduler.stats().num_waiting == 0


def test_the_backend_is_built_on_the_first_constrained_request_only(registry):
    manager = make_manager(registry, "xgrammar")
    try:
        assert manager._backend is None  # no tokenizer loaded for an engine that needs none
        manager.submit(StructuredOutputsParams(regex="a")).result(timeout=30)
        assert isinstance(manager._backend, XgrammarBackend)
        assert manager.vocab_size >= 49152
    finally:
        manager.shutdown()


def test_compiled_constraints_are_cached_by_the_constraint(xgrammar_manager, tokenizer):
    spec = StructuredOutputsParams(regex=r"cached-[0-9]+")
    before = xgrammar_manager.num_compiled
    first = xgrammar_manager.submit(spec).result(timeout=30)
    second = xgrammar_manager.submit(StructuredOutputsParams(regex=spec.regex)).result(timeout=30)
    assert xgrammar_manager.num_compiled == before + 1
    # Each request still gets its own grammar: advancing one leaves the other at the start.
    for token in tokenizer.encode("cached-", add_special_tokens=False):
        assert first.accept_token(token)
    assert not second.accept_token(tokenizer.encode("1", add_special_tokens=False)[0])
