"""Kept importable for one release: renamed plugserve.frontend.multi_api_server (the
launcher process of `server.api_server_count > 1` and its API servers' entry point)."""

from plugserve.frontend.multi_api_server import (
    API_SERVER_STOP_TIMEOUT_S,
    LAUNCHER_NAME,
    LISTEN_BACKLOG,
    SERVING,
    Launcher,
    api_server_name,
    listening_sockets,
    run_api_server_process,
    serve_with_api_servers,
)

__all__ = [
    "API_SERVER_STOP_TIMEOUT_S",
    "LAUNCHER_NAME",
    "LISTEN_BACKLOG",
    "SERVING",
    "Launcher",
    "api_server_name",
    "listening_sockets",
    "run_api_server_process",
    "serve_with_api_servers",
]
