"""/metrics: vLLM's metrics and plugserve's in Prometheus' text format
(frontend/metrics.py). A scrape asks no engine anything: their figures came with their
outputs."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from plugserve.frontend.metrics import CONTENT_TYPE
from plugserve.frontend.routes.endpoint_flow import EngineClientDep, error_response

router = APIRouter()


@router.get(
    "/metrics",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(client: EngineClientDep) -> Response:
    if client.metrics is None:  # not started: nothing served yet
        return error_response(503, "the engines have not started", "server_error")
    return Response(client.metrics.exposition(), media_type=CONTENT_TYPE)
