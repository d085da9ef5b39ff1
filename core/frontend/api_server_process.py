"""What one API-server process runs: its engine client (which waits for every engine's
handshake before anything is served), its renderer, the FastAPI app and uvicorn.

With one API server (`server.api_server_count: 1`) that is the process `plugserve serve`
started (serve.py), and it spawns the engine cores itself; with more, each runs in a
child of the launcher (multi_api_server.py).

If an engine dies, in-flight requests fail, the server stops and the process exits 1.
SIGINT (Ctrl-C) or SIGTERM drains the server: requests in flight get
`server.shutdown_timeout` seconds to finish while new ones are answered 503; then it stops
in order, engines included, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from plugserve.config import StackConfig
from plugserve.frontend.admission import Admission
from plugserve.frontend.api_server import build_app
from plugserve.frontend.engine_client import AsyncEngineClient
from plugserve.frontend.engines import EngineSupervision
from plugserve.frontend.middleware import Traffic
from plugserve.frontend.request_state import EngineDeadError
from plugserve.frontend.serving import OpenAIServing
from plugserve.generation_defaults import GenerationDefaults
from plugserve.interfaces.frontend import Renderer
from plugserve.logging_utils import configure_process_logging
from plugserve.model_files import resolve_model_path
from plugserve.plugins import PluginRegistry, get_registry
from plugserve.pooling_setup import pooling_setup

logger = logging.getLogger(__name__)

API_KEY_ENV = "PLUGSERVE_API_KEY"  # server.api_key, when the config does not set it
# After the drain (server.shutdown_timeout), what uvicorn waits for the connections left.
CLOSE_TIMEOUT_S = 1


def name_process(name: str) -> None:
    """Log lines and the process title (ps, top) say `name`."""
    configure_process_logging(name)
    try:
        import setproctitle

        setproctitle.setproctitle(f"plugserve::{name}")
    except ImportError:  # the title is a convenience for ps and top
        pass


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class ApiServerSetup:
    """What sets one API server apart from its siblings."""

    name: str  # process and log name, also in every response's x-plugserve-api-server
    client_index: int  # its channel to the engines
    addresses: dict[str, str]  # the transport's, for every API server and engine
    engines: EngineSupervision
    # Listening sockets handed over by the launcher; None: bind server.host:port here.
    sockets: list[socket.socket] | None = None
    stop_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
    on_serving: Callable[[], None] | None = None  # once it accepts requests


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT or SIGTERM once it has shut down, which ends
    the process before the engines have been stopped (SIGTERM) or prints a
    KeyboardInterrupt traceback (SIGINT, Ctrl-C). Here a stop signal drains the server
    first: the listening socket stays open and new requests are answered 503 while those
    in flight finish, for at most `shutdown_timeout` seconds; then it shuts down in order
    (what is still running is cancelled, which aborts it in the engine) and exits 0. A
    second signal ends the drain at once; a second SIGINT during the shutdown forces it."""

    def __init__(
        self,
        config: uvicorn.Config,
        setup: ApiServerSetup,
        traffic: Traffic | None = None,
        shutdown_timeout: float = 0.0,
    ) -> None:
        super().__init__(config)
        self.setup = setup
        self.traffic = traffic or Traffic()
        self.shutdown_timeout = shutdown_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._drain_deadline is None and not self.should_exit:
            self._drain_deadline = time.monotonic() + self.shutdown_timeout
            self.traffic.draining = True
            logger.info(
                "%s: finishing %d request(s) in flight (at most %.0f s); new ones get 503",
                signal.Signals(sig).name,
                self.traffic.in_flight,
                self.shutdown_timeout,
            )
            return
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    async def on_tick(self, counter: int) -> bool:
        deadline = self._drain_deadline
        if deadline is not None and not self.should_exit:
            if self.traffic.in_flight == 0:
                logger.info("every request in flight has finished: stopping")
                self.should_exit = True
            elif time.monotonic() >= deadline:
                logger.warning(
                    "shutdown_timeout: stopping with %d request(s) still in flight",
                    self.traffic.in_flight,
                )
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handlers = {sig: signal.signal(sig, self.handle_exit) for sig in self.setup.stop_signals}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        if sockets is not None:  # uvicorn only announces the sockets it binds itself
            url = http_url(self.config.host, self.config.port)
            logger.info("%s accepting requests on %s", self.setup.name, url)
        loop = type(asyncio.get_running_loop())
        http = self.config.http_protocol_class
        logger.info("event loop %s.%s, HTTP %s", loop.__module__, loop.__name__, http.__name__)
        if self.setup.on_serving is not None:
            self.setup.on_serving()


def run_api_server_loop(config: StackConfig, setup: ApiServerSetup) -> int:
    """Run one API server's event loop until it stops; the process's exit code.

    uvloop where it is installed (it is a dependency on Linux and macOS): the API
    server's CPU per streamed token is mostly event-loop and socket work, and at c=1
    every bit of it is taken from the engine's two compute threads."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_api_server(config, setup))
    return uvloop.run(run_api_server(config, setup))


async def run_api_server(config: StackConfig, setup: ApiServerSetup) -> int:
    """Serve until stopped; the process's exit code."""
    registry = get_registry(config.disabled_plugins)
    # Resolving here first converts a GGUF once, before the engine needs it too.
    model_path = str(resolve_model_path(config.model))
    stack = config.stack
    # The tokenizer takes seconds to load, as long as the engine takes to load the model:
    # it loads on a thread while the engines start, in their own processes.
    renderer_built = asyncio.ensure_future(
        asyncio.to_thread(
            registry.build,
            "renderer",
            stack.renderer,
            config.plugin_options(stack.renderer),
            model_path=model_path,
        )
    )
    server: uvicorn.Server | None = None
    exit_code = 0

    def on_engine_dead(_reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    client = AsyncEngineClient(
        config,
        addresses=setup.addresses,
        engines=setup.engines,
        client_index=setup.client_index,
        on_engine_dead=on_engine_dead,
    )
    try:
        await client.start()
        renderer = await renderer_built
    except EngineDeadError as exc:
        logger.error("%s", exc)
        await client.shutdown()
        return 1
    except BaseException:
        await client.shutdown()
        raise
    finally:
        if not renderer_built.done():  # the engines failed first; let the thread finish
            await asyncio.wait([renderer_built])
    try:
        app = _build_app(config, setup, registry, client, renderer, model_path)
    except BaseException:  # a plugin's hook, say: the engines must not outlive the failure
        await client.shutdown()
        raise
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
        ),
        setup,
        app.state.traffic,
        config.server.shutdown_timeout,
    )
    if setup.sockets is None:
        url = http_url(config.server.host, config.server.port)
        logger.info("serving %s on %s", app.state.openai_serving.model_name, url)
    try:
        await server.serve(sockets=setup.sockets)
    finally:
        await client.shutdown()
    if not server.started and exit_code == 0:
        return 1  # the port could not be bound, or startup failed
    return exit_code


def _build_app(
    config: StackConfig,
    setup: ApiServerSetup,
    registry: PluginRegistry,
    client: AsyncEngineClient,
    renderer: Renderer,
    model_path: str,
) -> FastAPI:
    """The app once the engines and the renderer are ready: the serving layer over the
    model's generation defaults, the admission bound, every plugin's metrics and
    endpoints."""
    stack = config.stack
    client.use_tokenizer(renderer.tokenizer, renderer.eos_token_id)
    model_name = config.server.served_model_name or config.model
    assert client.metrics is not None  # made once the engines are ready
    registry.register_metrics(client.metrics.plugin_registry, model_name)
    defaults = GenerationDefaults.load(
        model_path,
        renderer.eos_token_id,
        use_sampling=config.server.generation_config == "auto",
    )
    logger.info(
        "%s (server.generation_config: %s)", defaults.describe(), config.server.generation_config
    )
    serving = OpenAIServing(
        client,
        renderer,
        model_name,
        structured_output_backend=registry.get("structured_output", stack.structured_output),
        tool_parser=registry.get("tool_parser", stack.tool_parser),
        reasoning_parser=(
            registry.get("reasoning_parser", stack.reasoning_parser)
            if stack.reasoning_parser
            else None
        ),
        generation_defaults=defaults,
        model_root=config.model,
        log_requests=config.server.log_requests,
        pooling=pooling_setup(model_path, config.engine.runner, stack.pooler),
        max_num_batched_tokens=config.engine.max_num_batched_tokens,
    )
    engine = config.engine
    admission = Admission(
        engine.max_waiting_requests,
        max_num_seqs=engine.max_num_seqs,
        num_engines=engine.data_parallel_size,
        api_server_count=config.server.api_server_count,
    )
    return build_app(
        client,
        serving,
        config.server.api_key or os.environ.get(API_KEY_ENV) or None,
        server_name=setup.name,
        config=config,
        registry=registry,
        allowed_origins=config.server.allowed_origins,
        admission=admission,
    )
