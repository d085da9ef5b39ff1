"""`plugserve serve`: the API server in this process, the engine core in a child.

The engine starts first; the HTTP port opens once it has answered its handshake. If
the engine dies, in-flight requests fail, the server stops and the process exits 1.
SIGINT (Ctrl-C) or SIGTERM stops the server in order, engine included, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from plugserve.config import StackConfig
from plugserve.frontend.api_server import build_app
from plugserve.frontend.engine_client import AsyncEngineClient, EngineDeadError
from plugserve.frontend.serving import OpenAIServing
from plugserve.logging_utils import configure_process_logging
from plugserve.plugins import get_registry
from plugserve.worker.model_loader import resolve_model_path

logger = logging.getLogger(__name__)

PROCESS_TITLE = "plugserve::ApiServer"


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT or SIGTERM once it has shut down, which ends
    the process before the launcher has stopped the engine (SIGTERM) or prints a
    KeyboardInterrupt traceback (SIGINT, Ctrl-C). Here a signal asks the server to stop:
    it shuts down in order and exits 0. A second SIGINT still forces the exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(config: StackConfig) -> int:
    configure_process_logging("ApiServer")
    try:
        import setproctitle

        setproctitle.setproctitle(PROCESS_TITLE)
    except ImportError:  # the title is a convenience for ps and top
        pass
    return asyncio.run(_serve(config))


async def _serve(config: StackConfig) -> int:
    registry = get_registry(config.disabled_plugins)
    # Resolving here first converts a GGUF once, before the engine needs it too.
    model_path = str(resolve_model_path(config.model))
    stack = config.stack
    renderer = registry.build(
        "renderer", stack.renderer, config.plugin_options(stack.renderer), model_path=model_path
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
        tokenizer=renderer.tokenizer,
        eos_token_id=renderer.eos_token_id,
        on_engine_dead=on_engine_dead,
    )
    try:
        await client.start()
    except EngineDeadError as exc:
        logger.error("%s", exc)
        return 1
    model_name = config.server.served_model_name or config.model
    app = build_app(client, OpenAIServing(client, renderer, model_name), config.server.api_key)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    logger.info("serving %s on http://%s:%d", model_name, config.server.host, config.server.port)
    try:
        await server.serve()
    finally:
        await client.shutdown()
    if not server.started and exit_code == 0:
        return 1  # the port could not be bound, or startup failed
    return exit_code
