"""The smallest real third-party implementation of each slot that no example package fills
(tests/plugins/minimal/), each loaded as an unpackaged plugin module is
(PLUGSERVE_PLUGIN_MODULES), selected by its name, and serving the embedded model offline
next to the bundled stack: where a part does not change the numbers, the same greedy
tokens come out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plugserve import LLM, SamplingParams
from plugserve.plugins import PluginRegistry, set_registry
from plugserve.sampling_params import StructuredOutputsParams
from plugserve.worker.layers.linear import Linear

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
STACK = dict(dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)


@pytest.fixture(scope="module")
def bundled() -> Iterator[LLM]:
    """The bundled stack: what the parts that change no numbers must reproduce."""
    yield LLM(**STACK)


@pytest.fixture
def llm_with(monkeypatch: pytest.MonkeyPatch):
    """llm_with(module, **stack) → an LLM whose registry loaded `module` as a plugin
    module, on the stack named."""

    def build(module: str, **stack: object) -> LLM:
        monkeypatch.setenv("PLUGSERVE_PLUGIN_MODULES", module)
        previous = set_registry(PluginRegistry())
        try:
            return LLM(**{**STACK, **stack})
        finally:
            set_registry(previous)

    return build


def greedy_ids(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def test_the_plain_transcript_renderer_renders_a_chat_without_a_template(llm_with, bundled):
    llm = llm_with("tests.plugins.minimal.renderer", renderer="plain_transcript")
    [out] = llm.chat([{"role": "user", "content": "Name three planets."}], GREEDY)
    transcript = llm.tokenizer.encode("user: Name three planets.\nassistant:")
    assert out.prompt_token_ids == transcript
    assert out.outputs[0].token_ids == greedy_ids(bundled, [{"prompt_token_ids": transcript}])[0]
    with pytest.raises(ValueError, match="no template for tools"):
        llm.renderer.render_chat([{"role": "user", "content": "Hi"}], tools=[{"type": "function"}])


def test_the_whole_text_detokenizer_writes_what_the_incremental_one_does(llm_with, bundled):
    llm = llm_with("tests.plugins.minimal.detokenizer", detokenizer="whole_text")
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = bundled.generate(PROMPTS[:2], plain)
    assert [o.outputs[0].text for o in llm.generate(PROMPTS[:2], plain)] == [
        o.outputs[0].text for o in expected
    ]
    # A stop string from the middle of the first answer: cut there, by either.
    stop = expected[0].outputs[0].text.split()[2]
    stopped = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    [ours], [theirs] = llm.generate(PROMPTS[0], stopped), bundled.generate(PROMPTS[0], stopped)
    assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason == "stop"
    assert ours.outputs[0].stop_reason == theirs.outputs[0].stop_reason == stop
    assert ours.outputs[0].text == theirs.outputs[0].text


def test_the_free_list_allocator_serves_through_preemption_and_frees_every_block(llm_with, bundled):
    # Four blocks of 16 tokens for three requests of up to 30: some must be preempted.
    small = dict(num_kv_blocks=4, enable_prefix_caching=False, max_num_batched_tokens=64)
    llm = llm_with("tests.plugins.minimal.kv_allocator", kv_allocator="free_list", **small)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert greedy_ids(llm, PROMPTS, long) == greedy_ids(bundled, PROMPTS, long)
    assert llm.engine.stats().num_preemptions > 0
    allocator = llm.engine.scheduler.kv
    assert allocator.num_free_blocks == allocator.num_blocks


def test_the_forward_thread_executor_serves_with_the_grammar_built_meanwhile(llm_with, bundled):
    llm = llm_with("tests.plugins.minimal.executor", executor="forward_thread")
    assert greedy_ids(llm, PROMPTS) == greedy_ids(bundled, PROMPTS)
    choice = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=[" Paris", " Lyon", " Nice"]),
    )
    [ours], [theirs] = llm.generate(PROMPTS[0], choice), bundled.generate(PROMPTS[0], choice)
    assert ours.outputs[0].text == theirs.outputs[0].text
    assert llm.engine.stats().grammar_bitmask_steps > 0


def test_the_gather_attention_backend_gives_the_bundled_greedy_tokens(llm_with, bundled):
    llm = llm_with("tests.plugins.minimal.attention", attention="gather")
    assert greedy_ids(llm, PROMPTS) == greedy_ids(bundled, PROMPTS)


def test_the_fp16_weights_linear_method_runs_every_linear_with_the_bundled_tokens(
    llm_with, bundled
):
    llm = llm_with("tests.plugins.minimal.linear_method", linear_method="fp16_weights")
    linears = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(type(m.method).__name__ == "HalfPrecisionWeights" for m in linears)
    assert all(m.weight.dtype == torch.float16 and m.packed is None for m in linears)
    assert greedy_ids(llm, PROMPTS) == greedy_ids(bundled, PROMPTS)


def test_the_layer_spans_pass_names_each_layer_in_a_profile_and_changes_no_output(
    llm_with, bundled
):
    llm = llm_with("tests.plugins.minimal.model_pass", model_passes=["layer_spans"])
    model = llm.engine.executor.runner.model
    num_layers = len(model.model.layers)
    assert all(type(f).__name__ == "Span" for f in model.layer_fns)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ids = greedy_ids(llm, PROMPTS[:1])
    spans = [event.name for event in profile.events() if event.name.startswith("layer ")]
    assert set(spans) == {f"layer {i}" for i in range(num_layers)}
    assert len(spans) == num_layers * GREEDY.max_tokens  # each layer once a step
    assert ids == greedy_ids(bundled, PROMPTS[:1])
