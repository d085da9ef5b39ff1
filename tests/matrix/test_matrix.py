"""Every registered combination of transport × executor × attention backend that can run
on this machine, each scheduler in at least one of them, serves one shared scenario through
the real server, in float32 (or, for a backend that does not compute in float32, its first
dtype): an fp32 cell's greedy output equals the Hugging Face reference token for token (so
every other fp32 cell's). Each attention backend also serves in each of its other dtypes
(bf16) over a covering set of cells, in which every executor, scheduler and transport
appears: a bf16 cell agrees with Hugging Face bf16 by tests/correctness/agreement.py's
criterion. bf16 changes only the numeric path (executor × attention), which the float32
cells already cross with every transport; the covering set keeps the suite's time in
bounds as plugins are added.

The cells come from the plugin registry: a newly installed plugin joins with no edit
here. A component that cannot run on this machine says why through an optional
`unavailable_reason()` classmethod (capabilities.ReportsUnavailability), and its cells are
skipped with that reason. An attention backend that computes only in some dtypes lists
them in an optional `dtypes` class attribute (capabilities.HasDtypes, torch dtype names);
the others get float32 and bfloat16 cells.

Architectures besides the embedded Llama (SmolLM2) serve the same scenario too: each a
tiny checkpoint of its transformers family (tests/correctness/tiny_checkpoints.py) over
a covering set of float32 cells per attention backend, in which every scheduler,
transport and executor appears, held to transformers on that checkpoint (tokens equal,
logprobs within the harness's fp32 tolerance). The stack's plugins meet the model only
through the model runner, and tests/correctness proves each architecture in depth; the
covering set proves the stacks serve it, at a few cells' cost instead of the product's.

Each executor that runs pipeline stages (capabilities.RunsBatchesConcurrently) also
serves the scenario in one default-stack cell of two stages, fp32, token for token.

Every structured-output backend, tool parser and reasoning parser (the
`structured_output`, `tool_parser` and `reasoning_parser` slots) serves too, over a
covering set of default-stack float32 cells rather than across the product: the grammar
is applied in the model runner between the engine's two executor calls, and tool calls
and reasoning are parsed from the finished text, paths no other slot changes. A cell's
constrained completions are valid, its unconstrained one equals the reference, and the
call its model is made to write in the parser's family format comes back as
`tool_calls`, after a reasoning the thinking budget ended (the engine forcing the
reasoning parser's end marker, the grammar applying from there).

Every speculative-decoding proposer (the `spec_proposer` slot) serves the scenario on the
default stack in float32, speculating: its greedy output equals the reference token for
token, as any cell's (tests/correctness/test_speculative_matches_hf.py proves the
verification in depth).

Every pooler (the `pooler` slot, a third party's max pooling included) serves the
embedded all-MiniLM-L6-v2 on the default stack in float32 through /v1/embeddings: its
vectors equal transformers' BertModel hidden states pooled as the pooler says, then
normalised as the checkpoint's Normalize module does (tests/correctness proves each
pooling architecture in depth).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from correctness.agreement import Reference, assert_agrees, assert_clear_first_tokens
from correctness.tiny_checkpoints import (
    TinyCase,
    assert_matches,
    hf_references,
    tiny,
    tokenizer_folder,
    write_tiny_checkpoint,
)
from integration.conftest import GreedyCompletion, greedy_completion, server_under_test
from transformers import Qwen3Config

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.capabilities import (
    has_dtypes,
    has_tensor_parallel_limit,
    reports_unavailability,
    runs_batches_concurrently,
)
from plugserve.plugins import get_registry

SLOTS = ("scheduler", "transport", "executor", "attention")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 16
DTYPES = ("float32", "bfloat16")
# Executors that place their ranks on a cluster start one per server (many seconds):
# each serves only its pipeline cell, not the product; the other slots meet the
# executor contract the same way through mp, which crosses them all.
CLUSTER_EXECUTORS = ("ray",)
# The non-Llama architectures the stacks serve: Qwen3's q/k norm and a head_dim that is
# not hidden / heads, untied head.
ARCHITECTURES = [
    TinyCase("qwen3", Qwen3Config(**tiny(head_dim=32, tie_word_embeddings=False))),
]


@dataclass(frozen=True)
class Cell:
    scheduler: str
    transport: str
    executor: str
    attention: str
    tensor_parallel_size: int
    dtype: str
    pipeline_parallel_size: int = 1

    @property
    def id(self) -> str:
        stages = f"pp{self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else ""
        return (
            f"{self.scheduler}-{self.transport}-{self.executor}{self.tensor_parallel_size}"
            f"{stages}-{self.attention}-{self.dtype}"
        )

    def settings(self) -> list[str]:
        return [
            "--stack.scheduler", self.scheduler,
            "--stack.executor", self.executor,
            "--stack.attention", self.attention,
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--pipeline-parallel-size", str(self.pipeline_parallel_size),
            "--max-num-seqs", "8",
            "--kv-cache-memory", "32MiB",
            "--max-model-len", "512",
            "--dtype", self.dtype,
        ]  # fmt: skip


def _covering(names: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """Combinations in which every name of every slot appears at least once: row i takes
    the i-th name of each slot, cycling (the product when only one slot has choices)."""
    rows = max(len(n) for n in names.values())
    return [tuple(n[i % len(n)] for n in names.values()) for i in range(rows)]


def _product_cycling_schedulers(names: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """Every combination of the slots other than the scheduler, each with a scheduler taken
    in turn so that every scheduler appears (more rows where there are more schedulers).
    With the scenario's few prompts under max_num_seqs nothing waits or is preempted, so
    no policy changes a cell's steps here: where requests contend, the policies are proven
    by tests/unit/engine and tests/plugins."""
    schedulers = names["scheduler"]
    rest = [names[slot] for slot in SLOTS if slot != "scheduler"]
    combos = list(itertools.product(*rest))
    rows = max(len(combos), len(schedulers))
    return [(schedulers[i % len(schedulers)], *combos[i % len(combos)]) for i in range(rows)]


def matrix_cells() -> list:
    registry = get_registry()
    impls = {slot: registry.implementations(slot) for slot in SLOTS}
    names = {slot: sorted(impls[slot]) for slot in SLOTS}
    combos = []
    for attention in names["attention"]:
        cls = impls["attention"][attention].cls
        # A backend's own dtypes, of those the matrix has references for: the first gets
        # the full product, the others a covering set.
        dtypes = [d for d in DTYPES if d in (cls.dtypes if has_dtypes(cls) else DTYPES)]
        others = {slot: names[slot] for slot in SLOTS[:-1]}
        full = _product_cycling_schedulers({**others, "attention": [attention]})
        covering = _covering({**others, "attention": [attention]})
        combos += [(c, dtypes[0]) for c in full]
        combos += [(c, dtype) for dtype in dtypes[1:] for c in covering]
    params = []
    for names_, dtype in combos:
        cell, marks = _cell(impls, names_, dtype)
        if cell.executor not in CLUSTER_EXECUTORS:
            params.append(pytest.param(cell, id=cell.id, marks=marks))
    # Each executor that runs pipeline stages (batches in flight: the engine's batch
    # queue) in one default-stack cell of two stages: the stages change the executor's
    # and the engine's path only, which no other slot's choice meets.
    for executor in names["executor"]:
        if runs_batches_concurrently(impls["executor"][executor].cls):
            cell, marks = _cell(impls, ("fcfs", "zmq", executor, "torch"), "float32")
            cell = dataclasses.replace(cell, tensor_parallel_size=1, pipeline_parallel_size=2)
            if executor in CLUSTER_EXECUTORS:
                marks = [*marks, pytest.mark.ray]
            params.append(pytest.param(cell, id=cell.id, marks=marks))
    return params


def architecture_cells() -> list:
    """(architecture, cell) for each of ARCHITECTURES: per attention backend that computes
    in float32, a covering set of the other slots' names."""
    registry = get_registry()
    impls = {slot: registry.implementations(slot) for slot in SLOTS}
    others = {slot: sorted(impls[slot]) for slot in SLOTS[:-1]}
    others["executor"] = [e for e in others["executor"] if e not in CLUSTER_EXECUTORS]
    params = []
    for attention in sorted(impls["attention"]):
        cls = impls["attention"][attention].cls
        if has_dtypes(cls) and "float32" not in cls.dtypes:
            continue  # the references are fp32
        for names_ in _covering({**others, "attention": [attention]}):
            cell, marks = _cell(impls, names_, "float32")
            for case in ARCHITECTURES:
                params.append(pytest.param(case, cell, id=f"{case.id}-{cell.id}", marks=marks))
    return params


def _cell(impls: dict[str, Any], names_: tuple[str, ...], dtype: str) -> tuple[Cell, list]:
    """The cell of these slot names, and its skip mark where a component cannot run here."""
    chosen = dict(zip(SLOTS, names_, strict=True))
    executor_cls = impls["executor"][chosen["executor"]].cls
    # An executor that spans processes is exercised with two ranks.
    tp = 2
    if has_tensor_parallel_limit(executor_cls):
        tp = min(tp, executor_cls.max_tensor_parallel_size or tp)
    reasons = [
        reason
        for slot in SLOTS
        if (reason := _unavailable(impls[slot][chosen[slot]].cls)) is not None
    ]
    marks = [pytest.mark.skip(reason="; ".join(reasons))] if reasons else []
    return Cell(tensor_parallel_size=tp, dtype=dtype, **chosen), marks


def _unavailable(cls: type) -> str | None:
    return cls.unavailable_reason() if reports_unavailability(cls) else None


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_fp32(prompt_ids, hf_greedy_generate, tokenizer) -> list[GreedyCompletion]:
    """Greedy tokens and text from Hugging Face transformers `generate`, fp32, prompt by
    prompt (no logprobs: fp32 cells are compared token for token)."""
    ids = hf_greedy_generate(prompt_ids, MAX_TOKENS)
    return [GreedyCompletion(tokenizer.decode(t, skip_special_tokens=True), t, []) for t in ids]


@pytest.fixture(scope="module")
def hf_bf16(prompt_ids, hf_greedy_references) -> list[Reference]:
    references = hf_greedy_references(prompt_ids, MAX_TOKENS, torch.bfloat16)
    assert_clear_first_tokens(references, PROMPTS)
    return references


async def _scenario(server, **model: str) -> list[GreedyCompletion]:
    """Half the prompts streamed, half not, all at once; each token with its logprob.
    `model=`: the served model's name, where not the embedded model's."""
    async with server.async_openai_client() as client:
        answers = (
            greedy_completion(client, p, MAX_TOKENS, stream=bool(i % 2), **model)
            for i, p in enumerate(PROMPTS)
        )
        return list(await asyncio.gather(*answers))


# The default stack the output-slot cells vary only those two slots of.
OUTPUT_SLOTS_CELL = Cell("fcfs", "zmq", "uni", "torch", 1, "float32")


def server_args(item: pytest.Item, checkpoint: Callable[[TinyCase], Any]) -> tuple[str, list[str]]:
    """The transport and `plugserve serve` settings of a matrix test's server."""
    params = item.callspec.params
    if "output_slots" in params:
        backend, parser, reasoning = params["output_slots"]
        cell = OUTPUT_SLOTS_CELL
        slots = ["--stack.structured_output", backend, "--stack.tool_parser", parser]
        slots += ["--stack.reasoning_parser", reasoning]
        return cell.transport, [*cell.settings(), *slots]
    if "pooler" in params:
        cell = OUTPUT_SLOTS_CELL
        pooling = ["--model", POOLING_MODEL, "--stack.pooler", params["pooler"]]
        return cell.transport, [*cell.settings(), *pooling]
    if "spec_proposer" in params:
        cell = OUTPUT_SLOTS_CELL
        speculative = [
            "--stack.speculative.proposer", params["spec_proposer"],
            "--stack.speculative.num_tokens", "3",
        ]  # fmt: skip
        return cell.transport, [*cell.settings(), *speculative]
    cell = params["cell"]
    if "architecture" in params:
        return cell.transport, [*cell.settings(), "--model", checkpoint(params["architecture"])[0]]
    return cell.transport, cell.settings()


class ServerQueue:
    """Each cell's own fresh server, the next cell's launched as a cell takes its own.

    Most of a cell's time is its server starting (the API server, the engine and any
    worker processes importing torch and loading the model: ~10 s, mostly one core's
    work), its scenario ~4 s. Launched one cell ahead, a server starts on the core the
    cell before it leaves idle and is up, or nearly, when its cell comes; every cell
    still gets a server of its own, stopped (exit code checked) after it."""

    def __init__(
        self,
        request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory,
        checkpoint: Callable[[TinyCase], Any],
    ) -> None:
        self._items: list[pytest.Item] = request.session.items  # in run order
        self._module = request.module
        self._tmp = tmp_path_factory
        self._checkpoint = checkpoint
        self._launched: dict[str, PlugserveServer] = {}

    def _runs_here(self, item: pytest.Item) -> bool:
        return (
            getattr(item, "module", None) is self._module
            and "servers" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("skip") is None
        )

    def _launch(self, item: pytest.Item) -> PlugserveServer:
        transport, settings = server_args(item, self._checkpoint)
        log_path = self._tmp.mktemp("server") / f"server-{transport}.log"
        return server_under_test(transport, log_path, settings=settings).launch()

    @contextlib.contextmanager
    def serve(self, item: pytest.Item) -> Iterator[PlugserveServer]:
        """`item`'s server (launched ahead or now) for the block, as running_server's."""
        server = self._launched.pop(item.nodeid, None) or self._launch(item)
        later = self._items[self._items.index(item) + 1 :]
        upcoming = next((i for i in later if self._runs_here(i)), None)
        if upcoming is not None and upcoming.nodeid not in self._launched:
            self._launched[upcoming.nodeid] = self._launch(upcoming)
        with server.running() as served:
            yield served

    def close(self) -> None:
        """Servers launched for cells that did not run (a failure with -x, an interrupt)."""
        for server in self._launched.values():
            server.kill()
        self._launched.clear()


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, tiny_checkpoints) -> Iterator[ServerQueue]:
    queue = ServerQueue(request, tmp_path_factory, tiny_checkpoints)
    yield queue
    queue.close()


@pytest.mark.parametrize("cell", matrix_cells())
def test_cell_matches_hf(cell: Cell, request: pytest.FixtureRequest, servers: ServerQueue) -> None:
    with servers.serve(request.node) as server:
        completions = asyncio.run(_scenario(server))
        idle = server.wait_idle()
    if cell.dtype == "float32":
        expected = request.getfixturevalue("hf_fp32")
        assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
        assert [c.text for c in completions] == [e.text for e in expected]
    else:
        references = request.getfixturevalue("hf_bf16")
        for prompt, reference, c in zip(PROMPTS, references, completions, strict=True):
            assert_agrees(repr(prompt), reference, c.token_ids, c.logprobs)
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0


@pytest.fixture(scope="module")
def tiny_checkpoints(smollm2_path, tmp_path_factory, prompt_ids):
    """checkpoint(case) → (its folder, transformers' references for PROMPTS), each written
    and computed once."""
    tokenizer_files = tokenizer_folder(smollm2_path, tmp_path_factory.mktemp("tokenizer"))
    written: dict[str, tuple[str, list[Reference]]] = {}

    def checkpoint(case: TinyCase) -> tuple[str, list[Reference]]:
        if case.id not in written:
            folder = write_tiny_checkpoint(
                case.config, tmp_path_factory.mktemp(case.id), tokenizer_files
            )
            written[case.id] = (str(folder), hf_references(folder, prompt_ids, MAX_TOKENS))
        return written[case.id]

    return checkpoint


@pytest.mark.parametrize(("architecture", "cell"), architecture_cells())
def test_architecture_cell_matches_hf(
    architecture: TinyCase,
    cell: Cell,
    tiny_checkpoints,
    tokenizer,
    request: pytest.FixtureRequest,
    servers: ServerQueue,
) -> None:
    model, references = tiny_checkpoints(architecture)
    with servers.serve(request.node) as server:
        completions = asyncio.run(_scenario(server, model=model))
        idle = server.wait_idle()
    for prompt, reference, c in zip(PROMPTS, references, completions, strict=True):
        assert_matches(repr(prompt), reference, c.token_ids, c.logprobs)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0


OUTPUT_SLOTS = ("structured_output", "tool_parser", "reasoning_parser")
# Reasoning tokens before the engine forces the end marker, in the tool-call request.
THINKING_BUDGET = 4
# What a model of each bundled tool parser's family writes for get_weather(city="Paris").
# A third-party parser's cells skip until its format is added here.
TOOL_CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def output_slot_cells() -> list:
    registry = get_registry()
    impls = {slot: registry.implementations(slot) for slot in OUTPUT_SLOTS}
    params = []
    for names in _covering({slot: sorted(impls[slot]) for slot in OUTPUT_SLOTS}):
        reasons = [
            reason
            for slot, name in zip(OUTPUT_SLOTS, names, strict=True)
            if (reason := _unavailable(impls[slot][name].cls)) is not None
        ]
        if names[1] not in TOOL_CALL_TEXT:
            reasons.append(f"no recorded call text for tool parser {names[1]!r}")
        marks = [pytest.mark.skip(reason="; ".join(reasons))] if reasons else []
        params.append(pytest.param(names, id="-".join(names), marks=marks))
    return params


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}


async def _output_scenario(server, tool_parser: str) -> list[Any]:
    """One unconstrained greedy completion alongside a JSON-schema and a choice one, and a
    chat answer that writes a tool call in the tool parser's format."""
    async with server.async_openai_client() as client:

        async def constrained(constraint: dict) -> str:
            out = await client.completions.create(
                model="smollm2-135m-instruct",
                prompt=PROMPTS[0],
                max_tokens=24,
                temperature=0.0,
                extra_body={"structured_outputs": constraint},
            )
            assert out.choices[0].finish_reason == "stop"
            return out.choices[0].text

        async def tool_call(text: str) -> Any:
            # After a reasoning the budget ends, the model is made to write exactly the
            # family's call text; `auto` leaves it to the tool parser to find the call in
            # the answer.
            out = await client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER_TOOL],
                tool_choice="auto",
                max_tokens=64,
                temperature=0.0,
                extra_body={
                    "structured_outputs": {"choice": [text]},
                    "thinking_token_budget": THINKING_BUDGET,
                },
            )
            return out.choices[0]

        return await asyncio.gather(
            greedy_completion(client, PROMPTS[0], MAX_TOKENS, stream=False),
            constrained({"json": CITY_SCHEMA}),
            constrained({"choice": [" Paris", " Lyon"]}),
            tool_call(TOOL_CALL_TEXT[tool_parser]),
        )


@pytest.mark.parametrize("output_slots", output_slot_cells())
def test_output_slots(
    output_slots: tuple[str, str, str], request: pytest.FixtureRequest, servers: ServerQueue
) -> None:
    _, parser, _ = output_slots
    with servers.serve(request.node) as server:
        plain, as_json, choice, called = asyncio.run(_output_scenario(server, parser))
        idle = server.wait_idle()
    assert plain.token_ids == request.getfixturevalue("hf_fp32")[0].token_ids
    assert set(json.loads(as_json)) == {"city"}
    assert choice in (" Paris", " Lyon")
    assert called.finish_reason == "tool_calls"
    assert called.message.model_dump()["reasoning_content"]
    [call] = called.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0


def slot_cells(slot: str) -> list:
    """A cell per registered implementation of `slot`, skipped naming why where it
    cannot run here."""
    return [
        pytest.param(
            name,
            id=name,
            marks=[pytest.mark.skip(reason=reason)]
            if (reason := _unavailable(impl.cls)) is not None
            else [],
        )
        for name, impl in sorted(get_registry().implementations(slot).items())
    ]


# Prompts every bundled proposer has something to propose for: a text being copied (its
# tail recurs earlier in the prompt) and a run of one token. The scenario's PROMPTS alone
# may never give an n-gram a match in MAX_TOKENS tokens.
SPECULATION_PROMPTS = [
    "Copy: the quick brown fox jumps over the lazy dog. Copy: the quick brown fox jumps"
    " over the lazy dog. Copy: the quick",
    "Ha ha ha ha ha ha ha ha ha ha",
]


@pytest.fixture(scope="module")
def hf_fp32_speculation(tokenizer, hf_greedy_generate) -> list[GreedyCompletion]:
    ids = hf_greedy_generate([tokenizer.encode(p) for p in SPECULATION_PROMPTS], MAX_TOKENS)
    return [GreedyCompletion(tokenizer.decode(t, skip_special_tokens=True), t, []) for t in ids]


async def _speculation_scenario(server) -> list[GreedyCompletion]:
    async with server.async_openai_client() as client:
        prompts = [*PROMPTS, *SPECULATION_PROMPTS]
        answers = (
            greedy_completion(client, p, MAX_TOKENS, stream=bool(i % 2))
            for i, p in enumerate(prompts)
        )
        return list(await asyncio.gather(*answers))


@pytest.mark.parametrize("spec_proposer", slot_cells("spec_proposer"))
def test_spec_proposer_cell_matches_hf(
    spec_proposer: str, request: pytest.FixtureRequest, servers: ServerQueue
) -> None:
    with servers.serve(request.node) as server:
        completions = asyncio.run(_speculation_scenario(server))
        idle = server.wait_idle()
    expected = [
        *request.getfixturevalue("hf_fp32"),
        *request.getfixturevalue("hf_fp32_speculation"),
    ]
    assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
    assert [c.text for c in completions] == [e.text for e in expected]
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0
    # vLLM's speculative-decoding counters are served, and add up.
    spec = {
        name.partition("{")[0]: value
        for name, value in idle.items()
        if name.startswith("vllm:spec_decode_num_")
    }
    per_pos = sum(
        value
        for name, value in idle.items()
        if name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    )
    drafted = spec["vllm:spec_decode_num_draft_tokens_total"]
    accepted = spec["vllm:spec_decode_num_accepted_tokens_total"]
    # The copied text and the run are proposed for, and the model does go on with them.
    assert 0 < spec["vllm:spec_decode_num_drafts_total"] <= drafted
    assert 0 < accepted <= drafted and per_pos == accepted


# ------------------------------------------------------------------ the pooler slot

POOLING_MODEL = "all-minilm-l6-v2"
POOLING_SENTENCES = ["A man is eating food.", "hi", "The weather is lovely today, isn't it?"]
# What each pooler computes from one prompt's final hidden states [tokens, hidden].
POOLINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "last": lambda h: h[-1],
    "cls": lambda h: h[0],
    "mean": lambda h: h.mean(0),
    "all": lambda h: h,
    "max": lambda h: h.amax(0),
}


@pytest.fixture(scope="module")
def minilm_hidden_states() -> list[torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer

    from plugserve.model_files import resolve_model_path

    path = resolve_model_path(POOLING_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model(**tokenizer(s, return_tensors="pt")).last_hidden_state[0]
            for s in POOLING_SENTENCES
        ]


@pytest.mark.parametrize("pooler", slot_cells("pooler"))
def test_pooler_cell_matches_hf(
    pooler: str, request: pytest.FixtureRequest, servers: ServerQueue
) -> None:
    import httpx
    import numpy as np

    with servers.serve(request.node) as server:
        response = httpx.post(
            server.url("/v1/embeddings"), json={"input": POOLING_SENTENCES}, timeout=120
        )
        idle = server.wait_idle()
    assert response.status_code == 200, response.text
    if pooler not in POOLINGS:
        pytest.fail(f"pooler {pooler!r} has no reference here: add what it computes to POOLINGS")
    for data, hidden in zip(
        response.json()["data"], request.getfixturevalue("minilm_hidden_states"), strict=True
    ):
        expected = torch.nn.functional.normalize(POOLINGS[pooler](hidden), dim=-1)
        np.testing.assert_allclose(data["embedding"], expected.numpy(), rtol=0, atol=2e-5)
    assert idle["kv_cache_usage"] == 0 and idle["num_requests_running"] == 0
