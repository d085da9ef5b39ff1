"""The server under test: `plugserve serve` started as a real subprocess, once per
transport, plus the offline `LLM` whose greedy text the server must reproduce.

Every wait is bounded. A server is always stopped (SIGTERM, then SIGKILL) and its
engine process checked gone, whether its tests passed or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TRANSPORTS = ["zmq", "shm"]
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
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0

ENGINE_TITLE = "plugserve::EngineCore"
API_SERVER_TITLE = "plugserve::ApiServer"
# With --api-server-count N > 1: the launcher and its children ApiServer_0 … ApiServer_{N-1}.
LAUNCHER_TITLE = "plugserve::Launcher"
API_SERVER_CHILD_TITLE = "plugserve::ApiServer_"
API_SERVER_HEADER = "x-plugserve-api-server"  # which API-server process answered


# --------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; return that, or the last
    (falsy) value once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugserve_command() -> list[str]:
    """The console script of the environment running the tests (.venv/bin/plugserve)."""
    script = Path(sys.executable).parent / "plugserve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "plugserve.cli"]


def process_cmdline(pid: int) -> str:
    """The command line as ps shows it (setproctitle rewrites it); '' if pid is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def is_engine(pid: int) -> bool:
    return pid_alive(pid) and ENGINE_TITLE in process_cmdline(pid)


def is_api_server_child(pid: int) -> bool:
    return pid_alive(pid) and API_SERVER_CHILD_TITLE in process_cmdline(pid)


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


class ServerProcess:
    """One `plugserve serve` subprocess; its output goes to a log file."""

    def __init__(
        self,
        transport: str,
        log_path: Path,
        *,
        settings: Sequence[str] = SERVER_SETTINGS,
        env: dict[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            *plugserve_command(),
            "serve",
            "--port", str(self.port),
            "--stack.transport", transport,
            *settings,
        ]  # fmt: skip
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.pid = self.popen.pid
        self._engine_pids: list[int] = []
        self._api_server_pids: list[int] = []

    # ------------------------------------------------------------------ life cycle

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"plugserve serve exited with {self.popen.returncode} while starting:\n"
                    + self.log_tail()
                )
            # The log line first: a 200 from some other server that took the port
            # must not pass for ours.
            if f"running on {self.base_url}" in self.log_text():
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url("/health"), timeout=10).status_code == 200:
                        self._engine_pids = self.engine_pids()
                        self._api_server_pids = self.api_server_pids()
                        return
            time.sleep(0.25)
        raise TimeoutError(f"no healthy server within {timeout:.0f} s:\n" + self.log_tail())

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL; returns the exit code. Fails if the server did not exit
        on SIGTERM or left its engine or API-server processes behind."""
        engines = self._engine_pids
        api_servers = self._api_server_pids
        killed = False
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                self.popen.kill()
                self.popen.wait(10)

        def orphans() -> list[int]:
            return [pid for pid in engines if is_engine(pid)] + [
                pid for pid in api_servers if is_api_server_child(pid)
            ]

        left = [] if wait_until(lambda: not orphans(), 10) else orphans()
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        assert not killed, f"the server ignored SIGTERM for {timeout:.0f} s:\n{self.log_tail()}"
        assert not left, f"processes {left} outlived their server:\n{self.log_tail()}"
        return self.popen.returncode

    def kill_all(self) -> None:
        """Last resort for a test that failed half-way: nothing may outlive the test.
        (Pids are checked by title or through Popen, never reused blindly.)"""
        for pid in self._engine_pids + self._api_server_pids:
            if is_engine(pid) or is_api_server_child(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)

    # ------------------------------------------------------------------ inspection

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def engine_pids(self) -> list[int]:
        """The server's children titled plugserve::EngineCore (one per data-parallel rank)."""
        if self._engine_pids:
            return self._engine_pids
        return [c for c in children_of(self.pid) if ENGINE_TITLE in process_cmdline(c)]

    def api_server_pids(self) -> list[int]:
        """With --api-server-count N > 1, the children titled plugserve::ApiServer_<i>,
        in index order; [] for a server that is its own (only) API server."""
        if self._api_server_pids:
            return self._api_server_pids
        children = [
            c for c in children_of(self.pid) if API_SERVER_CHILD_TITLE in process_cmdline(c)
        ]
        return sorted(children, key=lambda pid: process_cmdline(pid).split()[0])

    def engine_pid(self) -> int:
        """The engine of a server with one engine."""
        engines = self.engine_pids()
        assert len(engines) == 1, f"engine processes among the server's children: {engines}"
        return engines[0]

    def metrics(self) -> dict[str, float]:
        response = httpx.get(self.url("/metrics"), timeout=10)
        assert response.status_code == 200, response.text
        values = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()
                values[name.removeprefix("plugserve_")] = float(value)
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits, the KV cache is empty and the
        engine's step counter stood still since the previous poll (the engine's figures
        come with its outputs, and the step that drops a last finished request from the
        runner is reported after it); returns the last metrics either way."""
        last: dict[str, float] = {}

        def idle() -> bool:
            steps = last.get("engine_steps_total")
            last.update(self.metrics())
            return (
                last["num_requests_running"] == 0
                and last["num_requests_waiting"] == 0
                and last["kv_cache_usage"] == 0
                and last["engine_steps_total"] == steps
            )

        wait_until(idle, timeout, interval=0.2)
        return last

    def openai_client(self, **kwargs: Any) -> openai.OpenAI:
        # No retries: a test must see the first answer, and a 503 must not be retried.
        options = {"max_retries": 0, "timeout": 120.0, **kwargs}
        return openai.OpenAI(base_url=self.url("/v1"), api_key="unused", **options)

    def async_openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        options = {"max_retries": 0, "timeout": 300.0, **kwargs}
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key="unused", **options)


@contextlib.contextmanager
def running_server(
    transport: str, log_dir: Path, *, check_exit: bool = True, **kwargs: Any
) -> Iterator[ServerProcess]:
    """A healthy server for the duration of the block; stopped afterwards. With
    `check_exit`, a server that was still up must exit 0 on SIGTERM."""
    server = ServerProcess(transport, log_dir / f"server-{transport}.log", **kwargs)
    with serving(server, check_exit=check_exit):
        yield server


@contextlib.contextmanager
def serving(server: ServerProcess, *, check_exit: bool = True) -> Iterator[ServerProcess]:
    """`running_server` for a server already launched (ServerProcess only starts the
    process): waits until it is healthy, then stops it as `running_server` does."""
    try:
        server.wait_healthy()
        yield server
        was_running = server.popen.poll() is None
        code = server.stop()
        if check_exit and was_running:
            assert code == 0, f"exit code {code} after SIGTERM:\n{server.log_tail()}"
    finally:
        server.kill_all()


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


@pytest.fixture(scope="session", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name = request.param
    require_bundled_transport(name)
    return name


@pytest.fixture(scope="session")
def zmq_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The shared zmq server, up for the whole session: besides the tests of both
    transports, the modules that want a default zmq server and leave it as they found it
    use it rather than starting their own (~14 s each to start and stop)."""
    require_bundled_transport("zmq")
    with running_server("zmq", tmp_path_factory.mktemp("shared-zmq")) as server:
        yield server


@pytest.fixture(scope="session")
def server(
    transport: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """One shared server per transport for the tests that leave it as they found it."""
    if transport == "zmq":
        yield request.getfixturevalue("zmq_server")
        return
    with running_server(transport, tmp_path_factory.mktemp(f"shared-{transport}")) as server:
        yield server


def transport_agnostic_server(zmq_server: ServerProcess) -> ServerProcess:
    """`server` for a module whose tests do not depend on the transport, which declares it
    as its own fixture (`server = pytest.fixture(name="server")(transport_agnostic_server)`):
    the session's shared zmq server, where the shared `server` runs each test once per
    transport. Not a fixture here, where it would replace `server` for every module."""
    return zmq_server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
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
