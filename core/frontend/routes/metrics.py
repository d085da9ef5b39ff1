"""/metrics: the engines' scheduler and step counters in Prometheus' text format."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from plugserve.frontend.engine_client import EngineDeadError
from plugserve.frontend.routes.shared import HEALTH_TIMEOUT_S, EngineClient, error_response
from plugserve.messages import FINISH_REASONS

router = APIRouter()


@router.get("/metrics")
async def metrics(client: EngineClient) -> Response:
    # The ping's answer carries fresh scheduler stats from the busy loop.
    try:
        await client.check_health(HEALTH_TIMEOUT_S)
    except (EngineDeadError, TimeoutError) as exc:
        return error_response(503, str(exc) or "engine not answering", "server_error")
    s = client.stats
    lines = [
        ("plugserve_num_requests_running", "gauge", s.num_running),
        ("plugserve_num_requests_waiting", "gauge", s.num_waiting),
        ("plugserve_kv_cache_usage", "gauge", s.kv_usage),
        ("plugserve_kv_cache_blocks", "gauge", s.num_kv_blocks),
        ("plugserve_kv_cache_free_blocks", "gauge", s.num_free_kv_blocks),
        ("plugserve_prefix_cache_queries_total", "counter", s.prefix_cache_queries),
        ("plugserve_prefix_cache_hits_total", "counter", s.prefix_cache_hits),
        ("plugserve_preemptions_total", "counter", s.num_preemptions),
        ("plugserve_engine_steps_total", "counter", s.num_steps),
        ("plugserve_engine_step_seconds_total", "counter", s.step_seconds),
        ("plugserve_engine_forward_seconds_total", "counter", s.forward_seconds),
        ("plugserve_engine_generated_tokens_total", "counter", s.num_generated_tokens),
        ("plugserve_grammar_bitmask_steps_total", "counter", s.grammar_bitmask_steps),
        ("plugserve_grammar_bitmask_seconds_total", "counter", s.grammar_bitmask_seconds),
        (
            "plugserve_grammar_forward_wait_seconds_total",
            "counter",
            s.grammar_forward_wait_seconds,
        ),
        (
            "plugserve_grammar_bitmask_hidden_steps_total",
            "counter",
            s.grammar_bitmask_hidden_steps,
        ),
    ]
    text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in lines)
    text += _labelled_counter(
        "plugserve_engine_requests_finished_total",
        "reason",
        {reason: s.num_finished.get(reason, 0) for reason in FINISH_REASONS},
    )
    text += _labelled_counter(
        "plugserve_engine_requests_total", "engine", dict(enumerate(client.requests_per_engine))
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _labelled_counter(name: str, label: str, values: dict) -> str:
    return f"# TYPE {name} counter\n" + "".join(
        f'{name}{{{label}="{key}"}} {value}\n' for key, value in values.items()
    )
