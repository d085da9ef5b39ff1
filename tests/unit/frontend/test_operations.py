"""What an operator who swaps plugserve in for vLLM expects, the pieces that need no
server: the model's generation defaults and EOS ids, the admission bound, the Responses
body as the chat it describes, and the order of the streamed Responses events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plugserve.frontend.admission import Admission, Overloaded
from plugserve.frontend.middleware import ServerGate, Traffic
from plugserve.frontend.routes.chat.protocol import ChatCompletionRequest
from plugserve.frontend.routes.completions.protocol import CompletionRequest
from plugserve.frontend.routes.responses.protocol import ResponsesRequest
from plugserve.frontend.routes.responses.serving import _Events, _StreamedItems
from plugserve.generation_defaults import GenerationDefaults
from plugserve.sampling_params import SamplingParams


def _folder(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_defaults_fill_only_what_a_request_leaves_out(tmp_path: Path):
    folder = _folder(
        tmp_path,
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": [2, 7]},
    )
    defaults = GenerationDefaults.load(folder, tokenizer_eos_id=2)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert defaults.extra_eos_token_ids == (7,)
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_p": 0.5})
    params = body.sampling_params(max_tokens=4, num_logprobs=None, defaults=defaults.sampling)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.5, 20, 0.0)
    zero = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    )
    assert zero.sampling_params(max_tokens=4, num_logprobs=None, defaults=defaults.sampling).greedy


def test_generation_config_none_keeps_the_eos_ids_but_not_the_sampling(tmp_path: Path):
    folder = _folder(tmp_path, {"temperature": 0.6, "eos_token_id": 9})
    defaults = GenerationDefaults.load(folder, tokenizer_eos_id=2, use_sampling=False)
    assert defaults.sampling == {} and defaults.extra_eos_token_ids == (9,)
    assert "none" in defaults.describe() and "9" in defaults.describe()
    assert GenerationDefaults.load(tmp_path / "missing", 2) == GenerationDefaults()


def test_every_eos_id_joins_the_stop_token_ids_unless_eos_is_ignored():
    defaults = GenerationDefaults({}, (7, 8))
    assert defaults.with_eos(SamplingParams(stop_token_ids=[8, 5])).stop_token_ids == [8, 5, 7]
    ignoring = SamplingParams(ignore_eos=True)
    assert defaults.with_eos(ignoring).stop_token_ids == []


def test_admission_refuses_past_running_plus_waiting_and_frees_on_release():
    admission = Admission(1, max_num_seqs=2, num_engines=2)  # 2 × (2 + 1) = 6 slots
    held = [admission.acquire(2), admission.acquire(4)]
    with pytest.raises(Overloaded) as refused:
        admission.acquire(1)
    assert refused.value.retry_after == 1
    held[0].release()
    held[0].release()  # idempotent
    admission.acquire(2)
    assert admission.in_flight == 6
    assert Admission(None, max_num_seqs=1).acquire(1000) is not None
    assert Admission(4, max_num_seqs=4, api_server_count=3).capacity == 3  # its share


def test_a_responses_body_becomes_the_chat_it_describes():
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
            "max_output_tokens": 7,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        }
    )
    chat = ChatCompletionRequest.model_validate(body.chat_body())
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"]
    assert chat.requested_max_tokens == 7 and chat.tools[0].function.name == "w"
    assert chat.effective_tool_choice.function.name == "w"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


def test_streamed_items_open_fill_and_close_in_openais_order():
    events = _Events()
    items = _StreamedItems(events)
    sent = items.feed({"content": "Hi"})
    sent += items.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "w"}}]})
    sent += items.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]})
    sent += items.feed({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    sent += items.close()
    kinds = [e.split(b"\n")[0].removeprefix(b"event: ").decode() for e in sent]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    message, call = items.output
    assert message["content"][0]["text"] == "Hi"
    assert (call["call_id"], call["arguments"], call["status"]) == (
        "call_1",
        '{"a":1}',
        "completed",
    )
    data = [json.loads(e.split(b"\ndata: ")[1]) for e in sent]
    assert [d["sequence_number"] for d in data] == list(range(len(sent)))
    assert {d["output_index"] for d in data[6:]} == {1}


def _gated(api_key: str | None = None) -> tuple[Any, Traffic]:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.state.request_id)

    routes = [Route("/v1/x", echo), Route("/open", echo)]
    traffic = Traffic()
    app = ServerGate(Starlette(routes=routes), api_key=api_key, identity="T", traffic=traffic)
    return app, traffic


def test_the_gate_names_each_request_by_its_x_request_id():
    from starlette.testclient import TestClient

    app, _ = _gated()
    with TestClient(app) as http:
        named = http.get("/open", headers={"x-request-id": "abc-1"})
        fresh = http.get("/open")
        bad = http.get("/open", headers={"x-request-id": "x" * 300})
    assert named.text == named.headers["x-request-id"] == "abc-1"
    assert fresh.text == fresh.headers["x-request-id"] and len(fresh.text) == 32
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_the_gate_asks_v1_routes_for_the_key_and_refuses_everything_while_draining():
    from starlette.testclient import TestClient

    app, traffic = _gated(api_key="k")
    with TestClient(app) as http:
        assert http.get("/v1/x").status_code == 401
        assert http.get("/v1/x", headers={"authorization": "Bearer kk"}).status_code == 401
        assert http.get("/v1/x", headers={"authorization": "Bearer k"}).status_code == 200
        assert http.get("/open").status_code == 200
        traffic.draining = True
        refused = http.get("/open")
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert traffic.in_flight == 0
