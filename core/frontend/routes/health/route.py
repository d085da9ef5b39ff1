"""/health (and /ping, vLLM's alias for SageMaker): a round trip to every engine's busy
loop, not a static 200; /version."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from plugserve import __version__
from plugserve.frontend.engine_client import EngineDeadError
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
        await client.check_health(HEALTH_TIMEOUT_S)
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except TimeoutError:
        return error_response(
            503, f"the engine did not answer within {HEALTH_TIMEOUT_S:.0f} s", "server_error"
        )
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
