"""The server under test: `plugserve serve` started as a real subprocess, on the default
transport or on each (pytest_generate_tests), plus the offline `LLM` whose greedy text the
server must reproduce.

The subprocess is plugserve.bench's server harness, which the benchmarks run too: every
wait is bounded, and a server is always stopped (SIGTERM, then SIGKILL) and checked to
leave no process behind, whether its tests passed or not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import PlugserveServer

from .launch_ahead import LaunchAhead, ServerSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TRANSPORTS = ["zmq", "shm"]
DEFAULT_TRANSPORT = "zmq"  # StackConfig's
# Small enough to keep the suite quick: 512 tokens of context makes the too-long-prompt
# cases cheap, 64 MiB of KV cache gives ~90 blocks of 16 tokens. One torch thread per
# process: the test process (offline reference) and the engine share a small machine,
# and oversubscribed OpenMP threads slow both down many times over.
MAX_MODEL_LEN = 512
NUM_THREADS = 1
# fp32, pinned: the reference (offline_llm) is fp32 and compares text exactly, and
# "auto" would serve bf16 on a GPU. bf16 serving has its own tests (test_bf16_served.py).
SERVER_SETTINGS = (
    "--dtype", "float32",
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--num-threads", str(NUM_THREADS),
    # SIGTERM drains: a test that stops its server mid-request waits this long at most.
    "--shutdown-timeout", "10",
)  # fmt: skip
API_SERVER_HEADER = "x-plugserve-api-server"  # which API-server process answered


# --------------------------------------------------------------------------- helpers


def running_thread_samples(pid: int, samples: int = 50, interval: float = 0.01) -> int:
    """Of `samples` looks at every thread of `pid` (its scheduler state in /proc), how many
    found one running: near zero for a process whose threads all block."""
    running = 0
    for _ in range(samples):
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
            except OSError:
                continue  # a thread that just ended
        running += "R" in states
        time.sleep(interval)
    return running


def transport_registered(name: str) -> bool:
    from plugserve.plugins import get_registry

    return name in get_registry().implementations("transport")


def require_bundled_transport(name: str) -> None:
    """A bundled transport that does not register is a broken install: the tests that use
    it fail, naming it, rather than skip."""
    if not transport_registered(name):
        pytest.fail(
            f"the bundled {name!r} transport plugin is not registered "
            f"(plugserve plugins lists no {name!r})"
        )


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response has `status` and OpenAI's error body; returns the inner error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


# --------------------------------------------------------------------------- the server


def server_under_test(
    transport: str,
    log_path: Path,
    *,
    settings: Sequence[str] = SERVER_SETTINGS,
    env: dict[str, str] | None = None,
) -> PlugserveServer:
    """A server with the tests' settings, offline, run from the repository root (where
    the test plugins that PLUGSERVE_PLUGIN_MODULES names import from); not launched."""
    return PlugserveServer(
        log_path,
        transport=transport,
        settings=settings,
        env={"HF_HUB_OFFLINE": "1", **(env or {})},
        cwd=REPO_ROOT,
    )


def running_server(
    transport: str,
    log_dir: Path,
    *,
    check_exit: bool = True,
    settings: Sequence[str] = SERVER_SETTINGS,
    env: dict[str, str] | None = None,
) -> contextlib.AbstractContextManager[PlugserveServer]:
    """A healthy server for the duration of the block; stopped afterwards. With
    `check_exit`, a server that was still up must exit 0 on SIGTERM. The same server
    launched ahead (launch_ahead.py) is taken where there is one."""
    wanted = server_under_test(
        transport, log_dir / f"server-{transport}.log", settings=settings, env=env
    )
    server = LAUNCH_AHEAD.take(ServerSpec.of(transport, tuple(settings), env), wanted)
    return server.running(check_exit=check_exit)


def _server_for(spec: ServerSpec, log_dir: Path) -> PlugserveServer:
    return server_under_test(
        spec.transport,
        log_dir / f"server-{spec.transport}.log",
        settings=spec.settings,
        env=dict(spec.env),
    )


LAUNCH_AHEAD = LaunchAhead(make=_server_for, defaults={"settings": SERVER_SETTINGS})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    LAUNCH_AHEAD.follow(item, nextitem)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    following = LAUNCH_AHEAD.following(item)
    if following is not None:
        LAUNCH_AHEAD.launch_for(following)
    yield


def pytest_sessionfinish() -> None:
    LAUNCH_AHEAD.kill_all()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if LAUNCH_AHEAD.launched:
        terminalreporter.write_line(
            f"servers launched one test ahead: {LAUNCH_AHEAD.launched}, "
            f"taken by their tests: {LAUNCH_AHEAD.taken}"
        )


@dataclass
class GreedyCompletion:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token


async def greedy_completion(
    client: openai.AsyncOpenAI,
    prompt: str | list[int],
    max_tokens: int,
    *,
    stream: bool,
    model: str = MODEL,
) -> GreedyCompletion:
    """A greedy completion of exactly `max_tokens` tokens, with each token's id (vLLM's
    return_tokens_as_token_ids) and logprob: what bf16 runs are compared by. `model`: the
    name the server serves (its --model, unless --served-model-name)."""
    kwargs: dict[str, Any] = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    if stream:
        chunks = await client.completions.create(stream=True, **kwargs)
        choices = [chunk.choices[0] async for chunk in chunks if chunk.choices]
    else:
        choices = [(await client.completions.create(**kwargs)).choices[0]]
    logprobs = [c.logprobs for c in choices if c.logprobs]
    return GreedyCompletion(
        text="".join(c.text for c in choices),
        token_ids=[int(t.removeprefix("token_id:")) for lp in logprobs for t in lp.tokens],
        logprobs=[v for lp in logprobs for v in lp.token_logprobs],
    )


# --------------------------------------------------------------------------- fixtures


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that depends on the transport runs on DEFAULT_TRANSPORT, or on each transport
    its `transports` marker names: those that exercise what a transport carries (streams,
    aborts, many connections, an engine's death, several API servers). The server's
    behaviour above the transport needs no second run; the transports' own contract is
    tests/unit/transports/, and the plugin matrix crosses them with every other slot."""
    if "transport" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("transports")
        names = marker.args if marker is not None else (DEFAULT_TRANSPORT,)
        metafunc.parametrize("transport", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def transport(request: pytest.FixtureRequest) -> str:
    name = request.param
    require_bundled_transport(name)
    return name


@pytest.fixture(scope="session")
def zmq_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlugserveServer]:
    """The shared zmq server, up for the whole session: the `server` of the default
    transport, and of the modules that want a default zmq server and leave it as they
    found it rather than starting their own (~7 s each to start and stop)."""
    require_bundled_transport("zmq")
    with running_server("zmq", tmp_path_factory.mktemp("shared-zmq")) as server:
        yield server


@pytest.fixture(scope="session")
def server(
    transport: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[PlugserveServer]:
    """One shared server per transport for the tests that leave it as they found it."""
    if transport == "zmq":
        yield request.getfixturevalue("zmq_server")
        return
    with running_server(transport, tmp_path_factory.mktemp(f"shared-{transport}")) as server:
        yield server


@pytest.fixture
def client(server: PlugserveServer) -> Iterator[openai.OpenAI]:
    with server.openai_client() as client:
        yield client


@pytest.fixture(scope="session")
def offline_llm():
    """The offline API on the same model and context, fp32: the reference text."""
    from plugserve import LLM

    return LLM(
        model=MODEL,
        kv_cache_memory="64MiB",
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
        max_num_seqs=32,
        num_threads=NUM_THREADS,
    )


# --------------------------------------------------------------------------- references

COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three planets."},
    ],
    [{"role": "user", "content": "Explain what a CPU does in one sentence."}],
]
MAX_TOKENS = 16
# For requests that must still be running when a test acts on them (hundreds of tokens
# on a CPU), with room left for a chat template's prompt within MAX_MODEL_LEN.
LONG_MAX_TOKENS = MAX_MODEL_LEN - 64


class Reference:
    """Greedy outputs of the offline LLM (computed in batches, cached): what the server
    must answer, token for token."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._cache: dict[tuple, Any] = {}

    def _params(self, max_tokens: int, ignore_eos: bool) -> Any:
        from plugserve import SamplingParams

        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)

    def completions(
        self, prompts: Sequence[str], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False
    ) -> list[Any]:
        """One offline RequestOutput per prompt."""
        keys = [("completion", p, max_tokens, ignore_eos) for p in prompts]
        missing = [p for p, k in zip(prompts, keys, strict=True) if k not in self._cache]
        if missing:
            outputs = self.llm.generate(missing, self._params(max_tokens, ignore_eos))
            for prompt, out in zip(missing, outputs, strict=True):
                self._cache["completion", prompt, max_tokens, ignore_eos] = out
        return [self._cache[k] for k in keys]

    def chats(
        self, conversations: Sequence[list[dict[str, str]]], max_tokens: int = MAX_TOKENS
    ) -> list[Any]:
        keys = [("chat", repr(c), max_tokens) for c in conversations]
        missing = [c for c, k in zip(conversations, keys, strict=True) if k not in self._cache]
        if missing:
            outputs = self.llm.chat(missing, self._params(max_tokens, False))
            for conv, out in zip(missing, outputs, strict=True):
                self._cache["chat", repr(conv), max_tokens] = out
        return [self._cache[k] for k in keys]

    def completion(self, prompt: str, **kwargs: Any) -> Any:
        return self.completions([prompt], **kwargs)[0]

    def chat(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        return self.chats([conversation], **kwargs)[0]


@pytest.fixture(scope="session")
def reference(offline_llm: Any) -> Reference:
    ref = Reference(offline_llm)
    ref.completions(COMPLETION_PROMPTS)
    ref.chats(CHAT_CONVERSATIONS)
    return ref


# --------------------------------------------------------------------------- reasoning

REASONING_API_KEY = "reasoning-test-key"


@pytest.fixture(scope="session")
def reasoning_server(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], PlugserveServer]]:
    """`reasoning_server(markers)`: a server of the tiny reasoning checkpoint
    (tests/reasoning_checkpoint.py) with the thinking markers as special tokens
    (`"special"`) or as text (`"text"`), the qwen3 reasoning parser and an API key
    (REASONING_API_KEY); started on first use, shared by every test that asks for it."""
    from reasoning_checkpoint import write_reasoning_checkpoint

    servers: dict[str, PlugserveServer] = {}
    with contextlib.ExitStack() as stack:

        def get(markers: str) -> PlugserveServer:
            if markers not in servers:
                folder = tmp_path_factory.mktemp(f"reasoning-{markers}")
                write_reasoning_checkpoint(smollm2_path, folder / "model", markers=markers)
                settings = (
                    "--model", str(folder / "model"),
                    "--reasoning-parser", "qwen3",
                    "--api-key", REASONING_API_KEY,
                    "--dtype", "float32",
                    "--kv-cache-memory", "16MiB",
                    "--max-model-len", "256",
                    "--num-threads", str(NUM_THREADS),
                )  # fmt: skip
                server = server_under_test("zmq", folder / "server.log", settings=settings)
                servers[markers] = stack.enter_context(server.running())
            return servers[markers]

        yield get
