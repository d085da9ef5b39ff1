"""`plugserve serve`: decides which processes serve.

With one API server (`server.api_server_count: 1`, the default) the API server runs in
this process (api_server_process.py) and spawns the engine cores itself. With more, this
process becomes the launcher (multi_api_server.py): it spawns the API servers and the
engine cores and only watches them.
"""

from __future__ import annotations

from plugserve.config import StackConfig
from plugserve.frontend.api_server_process import ApiServerSetup, name_process, run_api_server_loop
from plugserve.frontend.engines import SpawnedEngines, transport_addresses
from plugserve.frontend.multi_api_server import serve_with_api_servers

SINGLE_API_SERVER_NAME = "ApiServer"


def serve(config: StackConfig) -> int:
    """Serve `config` until stopped; the process's exit code."""
    if config.server.api_server_count > 1:
        return serve_with_api_servers(config)
    name_process(SINGLE_API_SERVER_NAME)
    addresses = transport_addresses(config)
    setup = ApiServerSetup(
        name=SINGLE_API_SERVER_NAME,
        client_index=0,
        addresses=addresses,
        engines=SpawnedEngines(config, addresses),
    )
    return run_api_server_loop(config, setup)
