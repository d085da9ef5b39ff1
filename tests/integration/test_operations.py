"""What an operator who swaps plugserve in for vLLM expects, against real
server subprocesses on a copy of the model folder whose generation_config.json carries
sampling defaults and a second EOS id:

- /tokenize and /detokenize (vLLM's shapes), /v1/responses through the openai SDK
  (streamed and not, with tools), /ping, /v1/models' vLLM fields;
- the model's sampling defaults when a request leaves them out, and none with
  `server.generation_config: none`; every EOS id of generation_config.json stops;
- 429 with Retry-After past engine.max_waiting_requests while the admitted complete;
  CORS; X-Request-Id; PLUGSERVE_API_KEY; the request log line;
- SIGTERM with a request in flight: it completes, a new one gets 503, exit 0, no orphans.

Two servers: `server` (generation_config auto, two running slots and one waiting, CORS for
one origin, an API key from the environment, request logs) and `plain_server`
(generation_config none), which the last test stops with SIGTERM.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.server_process import wait_until

from .conftest import MAX_MODEL_LEN, MODEL, SERVER_SETTINGS, assert_openai_error, running_server

API_KEY = "k-operations"
ALLOWED_ORIGIN = "http://allowed.example"
# The model's defaults: a temperature low enough that sampling is the greedy choice, so
# a request that leaves temperature out is seen to get it.
DEFAULT_TEMPERATURE = 0.001
EXTRA_EOS = " wise"  # a second end-of-sequence token: in STORY's continuation, not in the others
MAX_NUM_SEQS = 2
MAX_WAITING = 1
COMPOSE = [{"role": "user", "content": "Write one sentence about the sea."}]
STORY = "Once upon a time, in a small village,"


def _model_folder(tmp: Path, tokenizer: Any) -> tuple[Path, int]:
    """The served model's folder, linked file by file, with its own generation_config."""
    from plugserve.model_files import resolve_model_path

    source = resolve_model_path(MODEL)
    for path in source.iterdir():
        if path.name != "generation_config.json":
            (tmp / path.name).symlink_to(path)
    [extra_eos] = tokenizer.encode(EXTRA_EOS, add_special_tokens=False)
    config = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": [tokenizer.eos_token_id, extra_eos],
        "temperature": DEFAULT_TEMPERATURE,
    }
    (tmp / "generation_config.json").write_text(json.dumps(config))
    return tmp, extra_eos


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from plugserve.model_files import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(MODEL)))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, int]:
    return _model_folder(tmp_path_factory.mktemp("model"), tokenizer)


def _settings(folder: Path, *extra: str) -> tuple[str, ...]:
    return (*SERVER_SETTINGS, "--model", str(folder), "--served-model-name", MODEL, *extra)


@pytest.fixture(scope="module")
def server(
    model_folder: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlugserveServer]:
    settings = _settings(
        model_folder[0],
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-waiting-requests", str(MAX_WAITING),
        "--allowed-origins", json.dumps([ALLOWED_ORIGIN]),
        "--log-requests", "true",
    )  # fmt: skip
    log_dir = tmp_path_factory.mktemp("operations")
    env = {"PLUGSERVE_API_KEY": API_KEY}
    with running_server("zmq", log_dir, settings=settings, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(
    model_folder: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlugserveServer]:
    # A drain long enough for the request the SIGTERM test leaves in flight (and below
    # PlugserveServer.stop's patience).
    settings = _settings(model_folder[0], "--generation-config", "none", "--shutdown-timeout", "25")
    with running_server("zmq", tmp_path_factory.mktemp("plain"), settings=settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: PlugserveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=120
    ) as client:
        yield client


def _http(server: PlugserveServer, key: str | None = API_KEY) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# --------------------------------------------------------------------------- endpoints


def test_tokenize_then_detokenize_gives_the_prompt_back(server: PlugserveServer):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓"
    with _http(server, key=None) as http:
        tokens = http.post(
            "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
        )
        assert tokens.status_code == 200, tokens.text
        body = tokens.json()
        back = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 10
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_a_tokenized_chat_counts_what_a_chat_completion_bills(
    server: PlugserveServer, client: openai.OpenAI
):
    messages = [{"role": "system", "content": "Be brief."}, *COMPOSE]
    with _http(server, key=None) as http:
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        plain = http.post("/tokenize", json={"prompt": "Be brief."}).json()
    usage = _chat(client, messages, max_tokens=1).usage
    assert tokenized["count"] == usage.prompt_tokens
    assert tokenized["token_strs"] is None and plain["count"] < tokenized["count"]


def test_tokenize_refuses_bad_bodies_by_name(server: PlugserveServer):
    with _http(server, key=None) as http:
        unknown = http.post("/tokenize", json={"prompt": "x", "truncate": 3})
        both = http.post("/tokenize", json={"prompt": "x", "messages": COMPOSE})
        out_of_vocab = http.post("/detokenize", json={"tokens": [10**9]})
        wrong_model = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert assert_openai_error(unknown, 400)["param"] == "truncate"
    assert "exactly one of prompt and messages" in assert_openai_error(both, 400)["message"]
    assert assert_openai_error(out_of_vocab, 400)["param"] == "tokens"
    assert_openai_error(wrong_model, 404)


def test_models_lists_vllm_fields_and_ping_answers(server: PlugserveServer, model_folder):
    with _http(server) as http:
        [card] = http.get("/v1/models").json()["data"]
        pings = [http.get("/ping").status_code, http.post("/ping").status_code]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["root"] == str(model_folder[0]) and card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] is True and permission["organization"] == "*"
    assert pings == [200, 200]


def test_a_response_is_the_chat_completion_it_describes(client: openai.OpenAI):
    """instructions are the system message, input the user's; max_output_tokens cuts it
    short (incomplete); the usage is the chat's."""
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input=COMPOSE[0]["content"],
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    chat = _chat(
        client, [{"role": "system", "content": "Be brief."}, *COMPOSE], max_tokens=6, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 6
    assert response.instructions == "Be brief." and response.max_output_tokens == 6


def test_a_streamed_response_sends_openais_events(client: openai.OpenAI):
    conversation = [{"role": "user", "content": "Name a colour."}]
    whole = client.responses.create(model=MODEL, input=conversation, max_output_tokens=5)
    events = list(
        client.responses.create(model=MODEL, input=conversation, max_output_tokens=5, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # No temperature given: the model's default (near greedy) for both, so they agree.
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_response_calls_a_function_tool(client: openai.OpenAI):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        }
    ]
    asked = dict(
        model=MODEL, input="What is the weather in Paris?", tools=tools,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
    )  # fmt: skip
    response = client.responses.create(**asked)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    events = list(client.responses.create(**asked, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    # The call and its output go back as input: the model answers in text.
    follow_up = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
        ],
        tools=tools, tool_choice="none", max_output_tokens=8,
    )  # fmt: skip
    assert [item.type for item in follow_up.output] == ["message"]


def test_a_response_refuses_unknown_fields_by_name(server: PlugserveServer):
    with _http(server) as http:
        refused = http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "r"}
        )
        in_item = http.post(
            "/v1/responses",
            json={"model": MODEL, "input": [{"role": "user", "content": "hi", "audio": 1}]},
        )
    assert assert_openai_error(refused, 400)["param"] == "previous_response_id"
    assert assert_openai_error(in_item, 400)["param"] == "input.0.message.audio"


# --------------------------------------------------------------------------- defaults


def _samples(client: openai.OpenAI, **kwargs: Any) -> list[str]:
    """Three seeded samples of one story continuation."""
    completion = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=12, n=3, seed=11,
        extra_body={"ignore_eos": True}, **kwargs,
    )  # fmt: skip
    return [choice.text for choice in completion.choices]


def test_a_request_without_temperature_samples_at_the_models_default(
    server: PlugserveServer, client: openai.OpenAI
):
    assert f"temperature={DEFAULT_TEMPERATURE}" in server.log_text()
    greedy = _samples(client, temperature=0)[0]
    assert _samples(client) == [greedy] * 3  # the default (0.001): the greedy choice
    assert len(set(_samples(client, temperature=1.0))) > 1  # the request's own wins


def test_generation_config_none_keeps_openais_defaults(plain_server: PlugserveServer):
    assert "sampling defaults from generation_config.json: none" in plain_server.log_text()
    with plain_server.openai_client() as client:
        assert len(set(_samples(client))) > 1  # temperature 1


def test_every_eos_id_of_the_generation_config_stops(
    client: openai.OpenAI, model_folder: tuple[Path, int]
):
    extra_eos = model_folder[1]
    kwargs = dict(model=MODEL, prompt=STORY, max_tokens=32, temperature=0, logprobs=0)
    ids = {"return_tokens_as_token_ids": True}
    unstopped = client.completions.create(**kwargs, extra_body={**ids, "ignore_eos": True})
    tokens = [int(t.removeprefix("token_id:")) for t in unstopped.choices[0].logprobs.tokens]
    assert extra_eos in tokens, "the reference continuation must contain the second EOS"
    stopped = client.completions.create(**kwargs, extra_body=ids).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == extra_eos
    got = [int(t.removeprefix("token_id:")) for t in stopped.logprobs.tokens]
    assert got == tokens[: tokens.index(extra_eos) + 1]


# --------------------------------------------------------------------------- limits


def test_past_max_waiting_requests_a_request_gets_429_while_the_admitted_finish(
    server: PlugserveServer,
):
    body = {
        "model": MODEL, "prompt": STORY, "max_tokens": 24, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    with _http(server) as http:
        # Response headers come back once a request is admitted (its slot is held).
        streams = [
            http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            for _ in range(MAX_NUM_SEQS + MAX_WAITING)
        ]
        try:
            refused = http.post("/v1/completions", json={**body, "stream": False})
            texts = []
            for stream in streams:
                assert stream.status_code == 200
                events = [line for line in stream.iter_lines() if line.startswith("data: {")]
                last = json.loads(events[-1].removeprefix("data: "))
                assert last["choices"][0]["finish_reason"] == "length"
                texts.append("".join(json.loads(e[6:])["choices"][0]["text"] for e in events))
        finally:
            for stream in streams:
                stream.close()
        after = http.post("/v1/completions", json={**body, "stream": False})
    error = assert_openai_error(refused, 429)
    assert "capacity" in error["message"] and refused.headers["retry-after"] == "1"
    assert len(set(texts)) == 1  # every admitted request ran to its end
    assert after.status_code == 200  # and their slots are free again


def test_cors_preflight_is_answered_for_allowed_origins_only(server: PlugserveServer):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization",
    }
    with _http(server, key=None) as http:
        allowed = http.options(
            "/v1/chat/completions", headers={"origin": ALLOWED_ORIGIN, **preflight}
        )
        denied = http.options(
            "/v1/chat/completions", headers={"origin": "http://evil.example", **preflight}
        )
        simple = http.get(
            "/v1/models", headers={"origin": ALLOWED_ORIGIN, "authorization": f"Bearer {API_KEY}"}
        )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
    assert simple.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "x-request-id" in simple.headers["access-control-expose-headers"].lower()


def test_the_api_key_comes_from_the_environment(server: PlugserveServer):
    with _http(server, key="wrong") as wrong, _http(server) as right:
        assert_openai_error(wrong.get("/v1/models"), 401)
        assert right.get("/v1/models").status_code == 200


def test_x_request_id_names_the_request_and_is_echoed_and_logged(server: PlugserveServer):
    body = {"model": MODEL, "messages": COMPOSE, "max_tokens": 4, "temperature": 0}
    with _http(server) as http:
        named = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "op-42"})
        unnamed = http.post("/v1/chat/completions", json=body)
    assert named.headers["x-request-id"] == "op-42"
    assert named.json()["id"] == "chatcmpl-op-42"
    generated = unnamed.headers["x-request-id"]
    assert generated and unnamed.json()["id"] == f"chatcmpl-{generated}"
    usage = named.json()["usage"]

    def logged() -> re.Match | None:
        return re.search(
            r"request chatcmpl-op-42 finished: prompt_tokens=(\d+) output_tokens=(\d+) "
            r"ttft=\d+\.\d+s total=\d+\.\d+s finish_reason=length",
            server.log_text(),
        )

    line = wait_until(logged, 5)
    assert line is not None, server.log_tail()
    assert (int(line[1]), int(line[2])) == (usage["prompt_tokens"], usage["completion_tokens"])


# --------------------------------------------------------------------------- shutdown


def test_sigterm_finishes_the_request_in_flight_refuses_new_ones_and_exits_0(
    plain_server: PlugserveServer,
):
    """Runs last: it stops plain_server."""
    body = {
        "model": MODEL, "prompt": STORY, "max_tokens": 64, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    with (
        httpx.Client(base_url=plain_server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        plain_server.popen.send_signal(signal.SIGTERM)

        def refused() -> httpx.Response | None:
            with httpx.Client(base_url=plain_server.base_url, timeout=10) as fresh:
                # One token: taken before the signal was, it is over at once.
                answer = fresh.post(
                    "/v1/completions", json={**body, "stream": False, "max_tokens": 1}
                )
            return answer if answer.status_code == 503 else None

        during = wait_until(refused, 10)
        rest = [line for line in lines if line.startswith("data: {")]
    assert during is not None, plain_server.log_tail()
    assert "shutting down" in assert_openai_error(during, 503)["message"]
    chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    try:
        code = plain_server.popen.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after its last request:\n" + plain_server.log_tail())
    assert code == 0, plain_server.log_tail()
    assert not plain_server.stop().outlived
