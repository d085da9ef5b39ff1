"""Kept importable for one release, for code that started a server through
`plugserve.frontend.launcher.serve`: the module was split by the process that runs each
part. Import from plugserve.frontend.serve (the `plugserve serve` entry) and
plugserve.frontend.api_server_process (one API server's process) instead."""

from plugserve.frontend.api_server_process import (
    ApiServerSetup,
    http_url,
    name_process,
    run_api_server,
    run_api_server_loop,
)
from plugserve.frontend.serve import SINGLE_API_SERVER_NAME, serve

__all__ = [
    "SINGLE_API_SERVER_NAME",
    "ApiServerSetup",
    "http_url",
    "name_process",
    "run_api_server",
    "run_api_server_loop",
    "serve",
]
