"""The soak: a real server (plugserve.bench's PlugserveServer) under many requests of
every kind, a quarter of them from clients that leave part-way, and what must hold
afterwards.

What is sent: completions and chats, prompts of one word to a few hundred tokens, greedy
and sampled (seeded or not), stop strings, max_tokens, n, logprobs, streamed and not.
Each distinct request (a `Spec`) is first served alone: its answer is the reference. A
warm-up round follows, then the soak: `requests` draws from the specs, `concurrency` at
a time; a quarter of them leave, a stream after a random number of its events, a
non-streamed request after a random delay (one answered before it is not cancelled).

Afterwards (`SoakReport.failures`):
- no request failed: every answer was a 200, no connection broke, no stream sent an error;
- every request not cancelled got a complete answer (its n choices, each with a finish
  reason, the usage; a stream its [DONE]), equal to its spec's answer served alone where
  the spec is reproducible (greedy, or sampled with a seed): the text, the finish reason,
  the number of tokens, the logprobs' tokens (and values within 1e-3);
- the server is idle: vllm:num_requests_running and vllm:num_requests_waiting 0, every KV
  block free (vllm:kv_cache_usage_perc 0), as /metrics says;
- the resident memory of every process of the server (the API server and its children:
  the engine core, …) is within 10 % of what it was after the warm-up.

`make soak` runs main(): a thousand requests through each transport (--requests), printing
the figures; `--setting NAME=VALUE` (repeatable) changes the server's settings, e.g.
`--setting dtype=bfloat16 --setting batch_invariant=true --setting num_threads=2` for
bf16 greedy answers equal to the alone ones bit for bit. tests/integration/test_soak.py runs a short one in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from plugserve.bench.plugserve_server import PlugserveServer
from plugserve.bench.processes import descendants_of, process_cmdline
from plugserve.bench.server_process import wait_until
from tests.integration.conftest import (
    MODEL,
    SERVER_SETTINGS,
    TRANSPORTS,
    running_server,
    transport_registered,
)

LEAVING_SHARE = 0.25  # of the requests, whose clients disconnect part-way
MAX_LEAVE_DELAY_S = 1.5  # a non-streamed request's client leaves within this
MEMORY_TOLERANCE = 0.10
LOGPROB_TOLERANCE = 1e-3
IDLE_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 300.0
IDLE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)

# Prompts are stretches of this text: from one word to ~270 tokens (with a chat
# template's and the longest max_tokens' room, within the servers' 512 tokens).
TEXT = """
The lighthouse stood on a rock a mile from the harbour, and for a hundred years a keeper
lived in it with his family. Every evening he climbed the stairs, trimmed the wick and
lit the lamp, and every morning he wrote in the log what ships had passed, how the wind
had blown and whether the fog had come in from the sea. The children learned to row
before they could read, because the boat was the only road to school. In winter the
waves broke over the gallery and the whole tower shook, but the light never went out.
When the engineers came with electric cables and an automatic lamp, the last keeper
handed them the log books, forty volumes bound in green cloth, and moved to a cottage
on the hill, from which he could still see the beam sweep across the water each night.
He said that the machine was more reliable than any man, and that he did not miss the
stairs, but his neighbours noticed that he never drew his curtains before the light came
on. Years later a museum asked for the log books. Historians read them to learn about
storms, shipwrecks and the trade of the port; a biologist counted the birds the keepers
had seen; a novelist borrowed the names of the ships. Nobody had expected that a record
kept out of duty, by people who wrote a few lines a day, would become the most complete
account of a century of weather on that coast. The tower is still there. Visitors may
climb the stairs in summer, and from the gallery they can see the harbour, the hill, and
the cottage, where a light still burns in the window every evening.
"""
WORDS = TEXT.split()
PROMPT_WORDS = (1, 3, 10, 30, 90, 200)
STOPS = ((",",), (".",), (" the", "\n"), ("and",))


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Spec:
    """One distinct request."""

    chat: bool
    prompt: str
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int | None
    n: int
    stop: tuple[str, ...]
    logprobs: int | None  # top alternatives (chat: top_logprobs); None: no logprobs

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def reproducible(self) -> bool:
        """Whether the same request served alone must give the same answer."""
        return self.temperature == 0 or self.seed is not None

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "n": self.n,
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.logprobs is not None and self.chat:
            body.update(logprobs=True, top_logprobs=self.logprobs)
        elif self.logprobs is not None:
            body["logprobs"] = self.logprobs
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def make_specs(
    count: int,
    max_tokens: tuple[int, ...],
    rng: random.Random,
    prompt_words: tuple[int, ...] = PROMPT_WORDS,
) -> list[Spec]:
    specs: list[Spec] = []
    while len(specs) < count:
        words = rng.choice(prompt_words)
        start = rng.randrange(len(WORDS) - words)
        greedy = rng.random() < 0.5
        spec = Spec(
            chat=rng.random() < 0.5,
            prompt=" ".join(WORDS[start : start + words]),
            max_tokens=rng.choice(max_tokens),
            temperature=0.0 if greedy else rng.choice((0.7, 1.0)),
            # Sampled: mostly seeded (reproducible), some not (checked complete only).
            seed=None if greedy or rng.random() < 0.25 else rng.randrange(10_000),
            n=rng.choice((1, 1, 1, 2, 3)),
            stop=rng.choice(STOPS) if rng.random() < 0.3 else (),
            logprobs=rng.choice((0, 2)) if rng.random() < 0.3 else None,
        )
        if spec not in specs:
            specs.append(spec)
    return specs


# --------------------------------------------------------------------------- answers


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)  # the logprobs' tokens
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Answer:
    choices: dict[int, Choice] = field(default_factory=dict)
    completion_tokens: int | None = None
    done: bool = True  # a stream: its [DONE] came

    def add_chunk(self, chunk: dict[str, Any], chat: bool) -> None:
        """One streamed chunk's deltas."""
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        for c in chunk["choices"]:
            choice = self.choices.setdefault(c["index"], Choice())
            choice.text += (c["delta"].get("content") or "") if chat else c["text"]
            _add_logprobs(choice, c.get("logprobs"), chat)
            if c.get("finish_reason") is not None:
                choice.finish_reason = c["finish_reason"]

    @classmethod
    def of(cls, body: dict[str, Any], chat: bool) -> Answer:
        """A non-streamed answer."""
        answer = cls(completion_tokens=body["usage"]["completion_tokens"])
        for c in body["choices"]:
            text = (c["message"]["content"] or "") if chat else c["text"]
            choice = answer.choices[c["index"]] = Choice(text, c["finish_reason"])
            _add_logprobs(choice, c.get("logprobs"), chat)
        return answer

    def incomplete(self, spec: Spec) -> str | None:
        """What a complete answer to `spec` has and this one lacks, if anything."""
        if not self.done:
            return "the stream ended without [DONE]"
        if sorted(self.choices) != list(range(spec.n)):
            return f"choices {sorted(self.choices)} of n={spec.n}"
        for index, choice in self.choices.items():
            if choice.finish_reason not in ("stop", "length"):
                return f"choice {index} finished with {choice.finish_reason!r}"
            if spec.logprobs is not None and not choice.tokens and choice.text:
                return f"choice {index} has no logprobs"
        if self.completion_tokens is None:
            return "no usage"
        return None

    def difference(self, reference: Answer) -> str | None:
        """How this answer differs from `reference`, if it does."""
        for index, want in reference.choices.items():
            got = self.choices[index]
            if (got.text, got.finish_reason) != (want.text, want.finish_reason):
                return (
                    f"choice {index}: {got.text!r} ({got.finish_reason}), served alone "
                    f"{want.text!r} ({want.finish_reason})"
                )
            if got.tokens != want.tokens:
                return f"choice {index}: logprob tokens {got.tokens} != {want.tokens}"
            far = [
                (a, b)
                for a, b in zip(got.logprobs, want.logprobs, strict=True)
                if abs(a - b) > LOGPROB_TOLERANCE
            ]
            if far:
                return f"choice {index}: logprobs {far[:3]} differ from served alone"
        if self.completion_tokens != reference.completion_tokens:
            return f"{self.completion_tokens} tokens, served alone {reference.completion_tokens}"
        return None


def _add_logprobs(choice: Choice, logprobs: dict[str, Any] | None, chat: bool) -> None:
    if not logprobs:
        return
    if chat:
        for entry in logprobs.get("content") or []:
            choice.tokens.append(entry["token"])
            choice.logprobs.append(entry["logprob"])
    else:
        choice.tokens += logprobs["tokens"]
        choice.logprobs += logprobs["token_logprobs"]


# --------------------------------------------------------------------------- sending


@dataclass
class Sent:
    """One request of the soak: which spec, how, and when its client leaves (a stream:
    after this many events; otherwise after this many seconds; None: it stays)."""

    spec: int
    stream: bool
    leave: float | None = None
    cancelled: bool = False
    answer: Answer | None = None
    error: str | None = None


async def send(http: httpx.AsyncClient, server: PlugserveServer, spec: Spec, sent: Sent) -> None:
    try:
        if sent.stream:
            await _send_streamed(http, server, spec, sent)
        else:
            await _send(http, server, spec, sent)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        sent.error = f"{type(exc).__name__}: {exc}"


async def _send(http: httpx.AsyncClient, server: PlugserveServer, spec: Spec, sent: Sent) -> None:
    post = asyncio.ensure_future(http.post(server.url(spec.path), json=spec.body(stream=False)))
    done, _ = await asyncio.wait({post}, timeout=sent.leave)
    if not done:  # the client leaves: its connection closes
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
        sent.cancelled = True
        return
    response = post.result()
    if response.status_code != 200:
        sent.error = f"{response.status_code}: {response.text[:200]}"
        return
    sent.answer = Answer.of(response.json(), spec.chat)


async def _send_streamed(
    http: httpx.AsyncClient, server: PlugserveServer, spec: Spec, sent: Sent
) -> None:
    async with http.stream("POST", server.url(spec.path), json=spec.body(stream=True)) as response:
        if response.status_code != 200:
            sent.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
            return
        answer = Answer(done=False)
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                answer.done = True
                break
            if sent.leave is not None and events >= sent.leave:
                sent.cancelled = True  # leaving the block closes the connection
                return
            chunk = json.loads(data)
            if "error" in chunk:
                sent.error = f"error event: {chunk['error']}"
                return
            answer.add_chunk(chunk, spec.chat)
            events += 1
        sent.answer = answer


async def _send_all(
    server: PlugserveServer, specs: list[Spec], plan: list[Sent], concurrency: int
) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:

        async def one(sent: Sent) -> None:
            async with gate:
                await send(http, server, specs[sent.spec], sent)

        await asyncio.gather(*(one(sent) for sent in plan))


def references(server: PlugserveServer, specs: list[Spec]) -> list[Answer]:
    """Each spec's answer served alone (one request at a time, not streamed)."""
    answers = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for spec in specs:
            response = http.post(server.url(spec.path), json=spec.body(stream=False))
            assert response.status_code == 200, f"{spec}: {response.text}"
            answer = Answer.of(response.json(), spec.chat)
            assert answer.incomplete(spec) is None, f"{spec}: {answer.incomplete(spec)}"
            answers.append(answer)
    return answers


def make_plan(
    specs: list[Spec], refs: list[Answer], requests: int, rng: random.Random
) -> list[Sent]:
    """`requests` draws from the specs, half of them streamed; a quarter leave: a stream
    after 0 … as many events as its reference has tokens (chat: and a role chunk per
    choice), a non-streamed request within MAX_LEAVE_DELAY_S."""
    leaving = set(rng.sample(range(requests), round(requests * LEAVING_SHARE)))
    plan = []
    for i in range(requests):
        sent = Sent(spec=rng.randrange(len(specs)), stream=rng.random() < 0.5)
        if i in leaving and sent.stream:
            spec = specs[sent.spec]
            events = (refs[sent.spec].completion_tokens or 0) + spec.n * spec.chat
            sent.leave = rng.randint(0, events)
        elif i in leaving:
            sent.leave = rng.uniform(0, MAX_LEAVE_DELAY_S)
        plan.append(sent)
    return plan


# --------------------------------------------------------------------------- the server


def vllm_gauges(server: PlugserveServer) -> dict[str, float]:
    """The idle gauges, each summed over its engines, and the finished requests by reason."""
    response = httpx.get(server.url("/metrics"), timeout=10)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in IDLE_GAUGES:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            elif sample.name == "vllm:request_success_total":
                key = f"finished {sample.labels['finished_reason']}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def wait_idle(server: PlugserveServer) -> dict[str, float]:
    """The gauges once nothing runs or waits and no KV block is in use (or after
    IDLE_TIMEOUT_S: then the last ones)."""
    last: dict[str, float] = {}

    def idle() -> bool:
        last.update(vllm_gauges(server))
        return all(last.get(name) == 0 for name in IDLE_GAUGES)

    wait_until(idle, IDLE_TIMEOUT_S, interval=0.2)
    return last


def server_processes(server: PlugserveServer) -> dict[int, str]:
    """pid -> name of the server's process and all its descendants (the engine core…)."""
    found: dict[int, str] = {}
    for pid in [server.pid, *descendants_of(server.pid)]:
        title = process_cmdline(pid)
        if title:
            found[pid] = title.split()[0].removeprefix("plugserve::")[:40]
    return found


def resident_memory(pids: dict[int, str]) -> dict[str, int]:
    """'name pid' -> resident bytes (VmRSS) of each process still there."""
    rss = {}
    for pid, name in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[f"{name} {pid}"] = int(line.split()[1]) * 1024
    return rss


# --------------------------------------------------------------------------- the soak


@dataclass
class SoakReport:
    transport: str
    requests: int = 0
    cancelled: int = 0
    completed: int = 0
    compared: int = 0  # completed answers compared with their spec's answer served alone
    errors: list[str] = field(default_factory=list)  # failed or incomplete answers
    mismatches: list[str] = field(default_factory=list)
    memory_after_warmup: dict[str, int] = field(default_factory=dict)
    memory_after: dict[str, int] = field(default_factory=dict)
    gauges_after: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0

    def memory_growth(self) -> dict[str, float]:
        return {
            name: self.memory_after.get(name, 0) / before - 1
            for name, before in self.memory_after_warmup.items()
        }

    def failures(self) -> list[str]:
        failures = [f"error: {e}" for e in self.errors[:10]]
        failures += [f"mismatch: {m}" for m in self.mismatches[:10]]
        failures += [
            f"{name} is {self.gauges_after.get(name)} after the soak"
            for name in IDLE_GAUGES
            if self.gauges_after.get(name) != 0
        ]
        failures += [
            f"{name}: resident memory {growth:+.1%} since the warm-up"
            for name, growth in self.memory_growth().items()
            if abs(growth) > MEMORY_TOLERANCE
        ]
        if set(self.memory_after) != set(self.memory_after_warmup):
            failures.append(
                f"processes {sorted(self.memory_after_warmup)} became {sorted(self.memory_after)}"
            )
        return failures

    def summary(self) -> str:
        lines = [
            f"soak through {self.transport}: {self.requests} requests in {self.duration_s:.1f} s "
            f"({self.requests / max(self.duration_s, 1e-9):.1f}/s): {self.completed} completed "
            f"({self.compared} compared with the same request served alone), "
            f"{self.cancelled} cancelled by their clients, {len(self.errors)} errors, "
            f"{len(self.mismatches)} mismatches",
            "  after: " + ", ".join(f"{k} {v:g}" for k, v in sorted(self.gauges_after.items())),
        ]
        for name, before in self.memory_after_warmup.items():
            after = self.memory_after.get(name, 0)
            lines.append(
                f"  {name}: resident {before / 2**20:.1f} MiB after warm-up, "
                f"{after / 2**20:.1f} MiB after the soak ({after / before - 1:+.1%})"
            )
        return "\n".join(lines)


def soak(
    server: PlugserveServer,
    *,
    requests: int,
    concurrency: int = 32,
    num_specs: int = 32,
    max_tokens: tuple[int, ...] = (1, 4, 8, 16),
    prompt_words: tuple[int, ...] = PROMPT_WORDS,
    warmup: int | None = None,
    seed: int = 0,
) -> SoakReport:
    """Serve each spec alone, warm up with `warmup` requests (default: two rounds of
    `concurrency`), then soak with `requests` and report."""
    rng = random.Random(seed)
    specs = make_specs(num_specs, max_tokens, rng, prompt_words)
    refs = references(server, specs)
    warmup_plan = make_plan(specs, refs, 2 * concurrency if warmup is None else warmup, rng)
    asyncio.run(_send_all(server, specs, warmup_plan, concurrency))
    report = SoakReport(server.transport)
    report.errors += [f"warm-up: {s.error}" for s in warmup_plan if s.error]
    wait_idle(server)
    processes = server_processes(server)
    report.memory_after_warmup = resident_memory(processes)

    plan = make_plan(specs, refs, requests, rng)
    start = time.monotonic()
    asyncio.run(_send_all(server, specs, plan, concurrency))
    report.duration_s = time.monotonic() - start
    report.gauges_after = wait_idle(server)
    report.memory_after = resident_memory(processes)

    report.requests = len(plan)
    for i, sent in enumerate(plan):
        spec = specs[sent.spec]
        if sent.error is not None:
            report.errors.append(f"request {i} ({spec}): {sent.error}")
        elif sent.cancelled:
            report.cancelled += 1
        elif sent.answer is None or (missing := sent.answer.incomplete(spec)) is not None:
            report.errors.append(f"request {i} ({spec}): incomplete, {missing}")
        else:
            report.completed += 1
            if spec.reproducible:
                report.compared += 1
                if (diff := sent.answer.difference(refs[sent.spec])) is not None:
                    how = "streamed" if sent.stream else "not streamed"
                    report.mismatches.append(f"request {i} ({spec}, {how}): {diff}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="per transport")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--specs", type=int, default=48, help="distinct requests")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--transports", nargs="+", default=TRANSPORTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a server setting over the soak's own (dtype=bfloat16, batch_invariant=true)",
    )
    args = parser.parse_args(argv)
    settings = list(SERVER_SETTINGS)
    for setting in args.setting:
        name, equals, value = setting.partition("=")
        if not equals or not name:
            parser.error(f"--setting {setting!r}: expected NAME=VALUE")
        settings += [f"--{name.replace('_', '-')}", value]
    log_dir = Path(tempfile.mkdtemp(prefix="plugserve-soak-"))
    print(f"server logs in {log_dir}", flush=True)
    reports = []
    start = time.monotonic()
    for transport in args.transports:
        if not transport_registered(transport):
            print(f"the {transport!r} transport is not registered: skipped", flush=True)
            continue
        with running_server(transport, log_dir, settings=settings) as server:
            report = soak(
                server,
                requests=args.requests,
                concurrency=args.concurrency,
                num_specs=args.specs,
                max_tokens=tuple(args.max_tokens),
                seed=args.seed,
            )
        reports.append(report)
        print(report.summary(), flush=True)
    failures = [f"{r.transport}: {f}" for r in reports for f in r.failures()]
    print(
        f"soak: {sum(r.requests for r in reports)} requests, "
        f"{sum(r.cancelled for r in reports)} cancelled, "
        f"{sum(len(r.errors) for r in reports)} errors, "
        f"{sum(len(r.mismatches) for r in reports)} mismatches, "
        f"{time.monotonic() - start:.0f} s in all (server starts included)"
    )
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures or not reports else 0


if __name__ == "__main__":
    sys.exit(main())
