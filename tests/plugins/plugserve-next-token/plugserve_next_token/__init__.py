"""POST /v1/next_token, added to plugserve's API server by a plugin: the token the model
would write next after a prompt, greedily, with its logprob and the most likely
alternatives (a playground's "what comes next?").

Written only against plugserve's public surface: `plugserve.hookimpl`, SamplingParams,
and the ApiServer the `register_routes` hook gives (plugserve.interfaces).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve import hookimpl

if TYPE_CHECKING:
    from plugserve.interfaces.frontend import ApiServer


@hookimpl
def register_routes(server: ApiServer) -> None:
    # Imported here: every plugserve process loads this module, only an API server
    # builds routes.
    from plugserve_next_token.route import next_token_router

    server.include_router(next_token_router(server))
