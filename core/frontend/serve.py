"""`plugserve serve`: decides which processes serve.

With one API server (`server.api_server_count: 1`, the default) the API server runs in
this process (api_server_process.py) and starts the engine cores itself, forked from
this process before it runs a second thread (engines.py). With more, this
process becomes the launcher (multi_api_server.py): it spawns the API servers and the
engine cores and only watches them.
"""

from __future__ import annotations

from plugserve.child_processes import SHARED_MODULES, import_modules
from plugserve.config import StackConfig
from plugserve.frontend.api_server_process import ApiServerSetup, name_process, run_api_server_loop
from plugserve.frontend.engines import SpawnedEngines, transport_addresses
from plugserve.frontend.multi_api_server import LAUNCHER_NAME, serve_with_api_servers
from plugserve.model_files import resolve_supported_model
from plugserve.plugins import get_registry
from plugserve.pooling_setup import check_pooling_stack

SINGLE_API_SERVER_NAME = "ApiServer"


def serve(config: StackConfig) -> int:
    """Serve `config` until stopped; the process's exit code. A model that cannot be
    resolved, whose architecture no plugin registers, or that the stack cannot serve
    (check_pooling_stack) raises ValueError (one line) before any process starts."""
    several = config.server.api_server_count > 1
    name_process(LAUNCHER_NAME if several else SINGLE_API_SERVER_NAME)
    # A GGUF is converted here, once, before any child needs it.
    model_path = resolve_supported_model(
        config.model, get_registry(config.disabled_plugins).implementations("model")
    )
    check_pooling_stack(model_path, config)
    if several:
        return serve_with_api_servers(config)
    addresses = transport_addresses(config)
    engines = SpawnedEngines(config, addresses)
    import_modules(SHARED_MODULES)  # ours to need anyway (the tokenizer); imported once
    engines.prefork()  # while this process runs one thread; started once the channel is open
    setup = ApiServerSetup(
        name=SINGLE_API_SERVER_NAME,
        client_index=0,
        addresses=addresses,
        engines=engines,
    )
    return run_api_server_loop(config, setup)
