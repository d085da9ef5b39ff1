"""/bench/weight_read: the bandwidth floor of a batch-1 step, measured on an engine's own
weights, so that a benchmark (benchmarks/serving.py) can set latencies beside it."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from plugserve.frontend.request_state import EngineDeadError
from plugserve.frontend.routes.endpoint_flow import (
    HEALTH_TIMEOUT_S,
    EngineClientDep,
    error_response,
)

router = APIRouter()


@router.get("/bench/weight_read")
async def weight_read(client: EngineClientDep, seconds: float = 1.0, engine: int = 0) -> Response:
    """The bandwidth floor of a batch-1 step, measured on the engine's own weights:
    it reads them for `seconds` between two steps (running requests wait)."""
    if not 0 < seconds <= 10:
        return error_response(400, "seconds must be in (0, 10]", "invalid_request_error")
    try:
        read = await client.measure_weight_read(seconds, seconds + HEALTH_TIMEOUT_S, engine)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_request_error")
    except EngineDeadError as exc:
        return error_response(503, str(exc), "server_error")
    except TimeoutError:
        return error_response(503, "the engine did not answer in time", "server_error")
    if read.error is not None:
        return error_response(409, read.error, "invalid_request_error")
    return JSONResponse(
        {
            "engine": read.engine_index,
            "weight_bytes": read.weight_bytes,
            "read_bandwidth_gb_s": round(read.bytes_per_second / 1e9, 2),
            "floor_ms": round(read.weight_bytes / read.bytes_per_second * 1e3, 3),
        }
    )
