"""Fuzz: schemathesis against the server's own OpenAPI schema (/openapi.json of a real
server subprocess), every operation it lists, with bodies that the schema allows and
bodies that it does not. The served model's name is filled in, so that the generating
requests reach the engine; their output is kept short (max_tokens ≤ 8, n ≤ 2: a fuzzed
10**6 would only make the run long), everything else is as generated.

What must hold:
- no answer is a 5xx, nor a stream's error event of one (a stream starts with a 200);
- every answer is what the schema says: a documented status code and content type, errors
  in OpenAI's shape;
- the server stays healthy, with the same engine, idle afterwards, and a greedy request
  gives the same answer after the fuzz as before it.

Then the regressions for what it found, each against the same server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from plugserve.bench.plugserve_server import PlugserveServer

from .conftest import MODEL, assert_openai_error

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Examples per operation (one with nothing to vary is tried once), valid and invalid drawn
# alike; PLUGSERVE_FUZZ_EXAMPLES draws more.
MAX_EXAMPLES = int(os.environ.get("PLUGSERVE_FUZZ_EXAMPLES", "8"))
MAX_TOKENS = 8
MAX_N = 2
GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
GREEDY = [
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three planets."}]}),
]


@pytest.fixture(autouse=True)
def ieee_floats() -> Iterator[None]:
    """Hypothesis refuses to draw floats where subnormals flush to zero, and a -ffast-math
    kernel loaded earlier in this pytest process (its crtfastmath constructor) turned that
    on for the main thread. The default floating-point environment while a test here
    runs (glibc's FE_DFL_ENV), the one before it afterwards."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    saved = ctypes.create_string_buffer(64)  # a fenv_t is 28 bytes on x86-64
    libm.fegetenv(saved)
    libm.fesetenv(ctypes.c_void_p(-1))  # FE_DFL_ENV
    try:
        yield
    finally:
        libm.fesetenv(saved)


@pytest.fixture(scope="module")
def server(zmq_server: PlugserveServer) -> PlugserveServer:
    """The session's shared zmq server: fuzzing must leave it as it found it, which the
    greedy answers before and after show."""
    return zmq_server


def greedy_answers(server: PlugserveServer) -> list[str]:
    answers = []
    for path, fields in GREEDY:
        body = {"model": MODEL, "temperature": 0, "max_tokens": 16, **fields}
        response = httpx.post(server.url(path), json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        answers.append(choice["text"] if "text" in choice else choice["message"]["content"])
    return answers


def bound(case: schemathesis.Case) -> None:
    """The served model's name; short outputs (a body that is not an object stays as is)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body or case.operation.path in GENERATING:
        body["model"] = MODEL
    if case.operation.path not in GENERATING:
        return
    limit = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
    for name in (limit, "max_completion_tokens"):
        value = body.get(name)
        if name == limit or isinstance(value, int):
            body[name] = min(value, MAX_TOKENS) if _is_int(value) else MAX_TOKENS
    if _is_int(body.get("n")):
        body["n"] = min(body["n"], MAX_N)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stream_server_errors(response: Any) -> list[str]:
    """The error events of a 5xx in a server-sent stream (chat and completions: an
    `error` with its code; the Responses API: response.failed; Anthropic's Messages API:
    an `error` event of a server's error type)."""
    content_type = response.headers.get("content-type") or [""]  # schemathesis: lists
    if not content_type[0].startswith("text/event-stream"):
        return []
    found = []
    # Server-sent events end lines at CR or LF only: str.splitlines() would also split a
    # JSON string at a character such as U+2028 that a generated token may hold.
    for line in re.split(r"\r\n|\r|\n", response.text):
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        error = event.get("error")
        if event.get("type") == "error" and isinstance(error, dict) and "code" not in error:
            if error.get("type") in ("api_error", "overloaded_error"):
                found.append(json.dumps(error))
            continue
        if isinstance(error, dict) and int(error.get("code") or 500) >= 500:
            found.append(json.dumps(error))
        if event.get("type") == "response.failed":
            found.append(json.dumps(event["response"].get("error")))
    return found


def fuzz_operation(operation: Any, failures: list[str]) -> int:
    """Up to MAX_EXAMPLES cases of `operation`, valid and invalid; appends what went wrong
    to `failures`, returns how many cases were sent."""
    label = f"{operation.method.upper()} {operation.path}"
    sent = 0

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        # The same cases every run, so a failure is reproducible; PLUGSERVE_FUZZ_SEED
        # draws others.
        derandomize="PLUGSERVE_FUZZ_SEED" not in os.environ,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        case=st.one_of(
            operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE),
            operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE),
        )
    )
    def fuzz(case: schemathesis.Case) -> None:
        nonlocal sent
        bound(case)
        sent += 1
        response = case.call(timeout=60)
        problems = [f"stream error event {e}" for e in stream_server_errors(response)]
        try:
            case.validate_response(response, checks=CHECKS)
        except AssertionError as exc:  # schemathesis' FailureGroup
            problems += [str(f).strip().splitlines()[0] for f in getattr(exc, "exceptions", [exc])]
        if problems:
            failures.append(
                f"{label} {response.status_code}: {problems}\n  {case.as_curl_command()}"
            )

    if "PLUGSERVE_FUZZ_SEED" in os.environ:
        fuzz = seed(int(os.environ["PLUGSERVE_FUZZ_SEED"]))(fuzz)
    fuzz()
    return sent


def test_fuzzing_every_operation_gets_no_5xx_and_leaves_the_server_as_it_was(
    server: PlugserveServer,
):
    before = greedy_answers(server)
    engine = server.engine_pid()
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    failures: list[str] = []
    cases: dict[str, int] = {}
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        cases[label] = fuzz_operation(operation, failures)
    elapsed = time.monotonic() - started
    print(f"fuzz: {sum(cases.values())} cases in {elapsed:.1f} s: {cases}")
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])
    assert {label.split()[1] for label in cases} >= {
        *GENERATING,
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/health",
        "/ping",
        "/version",
        "/metrics",
    }
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    assert server.engine_pid() == engine and server.popen.poll() is None
    idle = server.wait_idle(timeout=30)
    assert (idle["num_requests_running"], idle["num_requests_waiting"]) == (0, 0), idle
    assert idle["kv_cache_usage"] == 0, idle
    assert greedy_answers(server) == before


# --------------------------------------------------------------------------- regressions


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_a_subnormal_bound_is_refused_before_it_reaches_the_engine(
    server: PlugserveServer, field: str
):
    """Found by the fuzz: top_p 5e-324 passed the API server's `> 0`, but the engine
    process compares subnormals as zero (its -ffast-math kernels set FTZ/DAZ), refused
    the request while decoding it, and died. Every process now judges it as zero."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, field: 5e-324}
    error = assert_openai_error(httpx.post(server.url("/v1/completions"), json=body), 400)
    assert field in error["message"]
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("priority", 2**63),
        ("top_k", 2**63),
        ("min_tokens", 2**63),
    ],
)
def test_an_integer_beyond_int64_is_refused_by_name(
    server: PlugserveServer, field: str, value: int
):
    """Found by the fuzz: a seed (or priority, top_k, min_tokens) that msgspec cannot
    carry to the engine was a 500 (OverflowError while sending); top_k past int64 would
    have stopped the engine in its int64 batch arrays."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, field: value}
    error = assert_openai_error(httpx.post(server.url("/v1/completions"), json=body), 400)
    assert error["param"] == field


def test_a_choice_the_vocabulary_cannot_spell_is_a_bad_request(server: PlugserveServer):
    """Found by the fuzz (PLUGSERVE_FUZZ_SEED=1): xgrammar allows no token of SmolLM2's
    vocabulary for a character whose UTF-8 starts with F1..F3 (U+40000 on). The request
    cannot be served as asked: a 400 that says why, streamed or not, not a server error."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "guided_choice": ["\U000a1234"]}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "no token of the model's vocabulary can continue" in error["message"]
    streamed = httpx.post(
        server.url("/v1/completions"), json={**body, "stream": True}, timeout=60
    ).text
    assert '"code": 400' in streamed or '"code":400' in streamed, streamed


def test_the_largest_seed_with_n_choices_is_served(server: PlugserveServer):
    """n choices sample with seed + i: from the largest seed allowed that still fits."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "n": 3, "seed": 2**63 - 1}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3


def test_the_schema_documents_errors_as_they_are_answered(server: PlugserveServer):
    """A body that fails validation is a 400 in OpenAI's shape, as the schema says (not
    FastAPI's 422); a stream is documented as server-sent events."""
    schema = httpx.get(server.url("/openapi.json"), timeout=10).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert "422" not in chat["responses"]
    error = chat["responses"]["default"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    message = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    assert message["items"]["discriminator"]["propertyName"] == "role"
