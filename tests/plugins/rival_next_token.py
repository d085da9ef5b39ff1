"""A test plugin that claims POST /v1/next_token too, which the example plugin already
serves. Loaded by the server under test through PLUGSERVE_PLUGIN_MODULES, with this
folder on PYTHONPATH."""

from __future__ import annotations

from typing import Any

from plugserve import hookimpl


@hookimpl
def register_routes(server: Any) -> None:
    from fastapi import APIRouter

    router = APIRouter()
    router.add_api_route("/v1/next_token", lambda: {}, methods=["POST"])
    server.include_router(router)
