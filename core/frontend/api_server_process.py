"""What one API-server process runs: its engine client (which waits for every engine's
handshake before anything is served), its renderer, the FastAPI app and uvicorn.

With one API server (`server.api_server_count: 1`) that is the process `plugserve serve`
started (serve.py), and it spawns the engine cores itself; with more, each runs in a
child of the launcher (multi_api_server.py).

If an engine dies, in-flight requests fail, the server stops and the process exits 1.
SIGINT (Ctrl-C) or SIGTERM stops the server in order, engines included, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn

from plugserve.config import StackConfig
from plugserve.frontend.api_server import build_app
from plugserve.frontend.engine_client import AsyncEngineClient, EngineDeadError
from plugserve.frontend.engines import EngineSupervision
from plugserve.frontend.serving import OpenAIServing
from plugserve.logging_utils import configure_process_logging
from plugserve.model_files import resolve_model_path
from plugserve.plugins import get_registry

logger = logging.getLogger(__name__)


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
    KeyboardInterrupt traceback (SIGINT, Ctrl-C). Here a stop signal asks the server to
    stop: it shuts down in order and exits 0. A second SIGINT still forces the exit."""

    def __init__(self, config: uvicorn.Config, setup: ApiServerSetup) -> None:
        super().__init__(config)
        self.setup = setup

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
    client.use_tokenizer(renderer.tokenizer, renderer.eos_token_id)
    model_name = config.server.served_model_name or config.model
    serving = OpenAIServing(
        client,
        renderer,
        model_name,
        structured_output_backend=registry.get("structured_output", stack.structured_output),
        tool_parser=registry.get("tool_parser", stack.tool_parser),
    )
    app = build_app(client, serving, config.server.api_key, server_name=setup.name)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        ),
        setup,
    )
    if setup.sockets is None:
        url = http_url(config.server.host, config.server.port)
        logger.info("serving %s on %s", model_name, url)
    try:
        await server.serve(sockets=setup.sockets)
    finally:
        await client.shutdown()
    if not server.started and exit_code == 0:
        return 1  # the port could not be bound, or startup failed
    return exit_code
