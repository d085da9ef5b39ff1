"""/health (and /ping, vLLM's alias for SageMaker): a round trip to every engine's busy
loop, not a static 200; /version.

With data parallelism, a server that has lost some of its engines still serves on the
others: /health then answers 200 with a body that says it is degraded and why, so that
a load balancer keeps sending it requests and an operator sees what is missing. It
answers 503 once no engine serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from plugserve import __version__
from plugserve.frontend.request_state import EngineDeadError
from plugserve.frontend.routes.endpoint_flow import (
    HEALTH_TIMEOUT_S,
    EngineClientDep,
    error_response,
)

router = APIRouter()


# A 200 with an empty body (response_class: no media type in the schema).
@router.get("/health", response_class=Response)
@router.get("/ping", response_class=Response)
@router.post("/ping", response_class=Response)
async def health(client: EngineClientDep) -> Response:
    try:
        out_of_service = await client.check_health(HEALTH_TIMEOUT_S)
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except TimeoutError:
        return error_response(
            503, f"the engine did not answer within {HEALTH_TIMEOUT_S:.0f} s", "server_error"
        )
    if out_of_service:
        return JSONResponse(degraded(client.num_engines, out_of_service))
    return Response(status_code=200)


def degraded(num_engines: int, out_of_service: dict[int, str]) -> dict[str, Any]:
    """The body of a degraded server's /health: each engine's state."""
    engines: list[dict[str, Any]] = []
    for index in range(num_engines):
        if index in out_of_service:
            engines.append(
                {"index": index, "status": "out_of_service", "reason": out_of_service[index]}
            )
        else:
            engines.append({"index": index, "status": "serving"})
    return {"status": "degraded", "engines": engines}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
