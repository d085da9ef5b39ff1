"""`server.log_requests`: one info line per finished request, as an operator reads it.

    request chatcmpl-4f2a… finished: prompt_tokens=12 output_tokens=16 ttft=0.084s
    total=0.412s finish_reason=length

One line per HTTP request (its n choices and prompts together: tokens summed, TTFT to
the first token of any, the finish reasons of all, distinct, in choice order). A request
whose client left before the end says `abort`, one the engine failed `error`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

logger = logging.getLogger("plugserve.requests")


async def logged(
    request_id: str, num_prompt_tokens: int, deltas: AsyncGenerator[tuple[int, Any], None]
) -> AsyncGenerator[tuple[int, Any], None]:
    """`deltas` ((choice index, RequestDelta) pairs) passed through unchanged; the line
    is logged when they end, however they end."""
    start = time.monotonic()
    first: float | None = None
    output_tokens: dict[int, int] = {}
    reasons: dict[int, str] = {}
    outcome: str | None = None
    try:
        async for index, delta in deltas:
            if first is None and delta.token_ids:
                first = time.monotonic()
            output_tokens[index] = delta.num_output_tokens
            if delta.finish_reason is not None:
                reasons[index] = delta.finish_reason
            yield index, delta
    except BaseException as exc:  # the client left (abort) or the engine failed (error)
        outcome = "abort" if isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else "error"
        raise
    finally:
        end = time.monotonic()
        await deltas.aclose()  # the engine requests' aborts, now rather than when collected
        if outcome is None:
            finish = ",".join(dict.fromkeys(reasons[i] for i in sorted(reasons))) or "abort"
        else:
            finish = outcome
        ttft = f"{first - start:.3f}s" if first is not None else "-"
        logger.info(
            "request %s finished: prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs "
            "finish_reason=%s",
            request_id,
            num_prompt_tokens,
            sum(output_tokens.values()),
            ttft,
            end - start,
            finish,
        )
