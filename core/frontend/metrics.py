"""What /metrics serves: vLLM's metric names and types, through prometheus-client, and the
plugserve_* figures of earlier releases, in every API-server process.

Where the figures come from (nothing asks the engines when a scraper calls):
- the engines' scheduler figures arrive with their outputs (`SchedulerStats`: gauges as
  they are, counters as increments, each increment to one API server only);
- per-request figures (tokens, TTFT, inter-token latency, end-to-end latency, finish
  reason) are measured here, in the engine client, from when a request arrived and when
  its outputs came back; the queue time is the engine's own measure, sent with the
  request's first output.

Several API servers (`server.api_server_count` > 1) aggregate through prometheus-client's
multiprocess mode: the launcher points PROMETHEUS_MULTIPROC_DIR at a fresh directory
before it spawns them (and removes it at exit), every API server's metrics write their
values there, and whichever API server answers a scrape reads them all: counters and
histograms are summed over the processes, and the engines' gauges
(`multiprocess_mode="mostrecent"`, as vLLM) are the latest value any process received.
A single collector instead (one process gathering every API server's figures) would
need another channel between the API servers; the directory is vLLM's own answer.

The plugserve_* names of earlier releases (the engine's step and grammar counters, which
benchmarks and tests read) stay: their counters are prometheus-client counters like the
rest, and their gauges, sums over the engines, are computed at each scrape from the
per-engine vLLM gauges.

A plugin adds its own metrics through the `register_metrics` hook (hookspecs.py),
called once per API-server process with the registry that process serves.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from plugserve.messages import FINISH_REASONS, SchedulerStats

if TYPE_CHECKING:
    from plugserve.messages import EngineCoreOutput

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Neither vLLM nor the multiprocess mode serves the *_created series.
prometheus_client.disable_created_metrics()

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


# The engines' counters of earlier releases, summed over the engines:
# (name as served without _total, SchedulerStats field, help).
LEGACY_COUNTERS = (
    (
        "plugserve_prefix_cache_queries",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "plugserve_prefix_cache_hits",
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
    ),
    ("plugserve_preemptions", "num_preemptions", "Requests preempted (by recompute)."),
    ("plugserve_engine_steps", "num_steps", "Engine steps."),
    ("plugserve_engine_step_seconds", "step_seconds", "Seconds in engine steps."),
    (
        "plugserve_engine_forward_seconds",
        "forward_seconds",
        "Seconds of engine steps in the executor (forward pass and sampling).",
    ),
    ("plugserve_engine_generated_tokens", "num_generated_tokens", "Output tokens generated."),
    ("plugserve_engine_prompt_tokens", "num_prompt_tokens", "Prompt tokens computed."),
    ("plugserve_engine_pings", "num_pings", "Health pings the engines answered."),
    (
        "plugserve_grammar_bitmask_steps",
        "grammar_bitmask_steps",
        "Steps that built a grammar bitmask.",
    ),
    (
        "plugserve_grammar_bitmask_seconds",
        "grammar_bitmask_seconds",
        "Seconds building grammar bitmasks.",
    ),
    (
        "plugserve_grammar_forward_wait_seconds",
        "grammar_forward_wait_seconds",
        "Seconds still waited for the forward pass after the grammar bitmask was done.",
    ),
    (
        "plugserve_grammar_bitmask_hidden_steps",
        "grammar_bitmask_hidden_steps",
        "Steps whose forward pass hid the whole grammar bitmask.",
    ),
)


@contextlib.contextmanager
def multiprocess_directory() -> Iterator[str]:
    """For a launcher of several API servers, before it spawns them: a fresh, empty
    PROMETHEUS_MULTIPROC_DIR in the environment they inherit (stale files of an earlier
    run would add to the counts), removed with its files on the way out."""
    path = tempfile.mkdtemp(prefix="plugserve-metrics-")
    previous = os.environ.get(MULTIPROC_DIR_ENV)
    os.environ[MULTIPROC_DIR_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def remove_orphaned_multiprocess_directory() -> None:
    """For an API server of a launcher, on its way out: a launcher removes the metrics
    directory when it stops, but a killed one cannot; then its API servers do."""
    path = os.environ.get(MULTIPROC_DIR_ENV)
    launcher = multiprocessing.parent_process()
    if path and launcher is not None and not launcher.is_alive():
        shutil.rmtree(path, ignore_errors=True)


class _Timing:
    """What the metrics keep of one request in flight."""

    __slots__ = ("arrival", "engine", "first_token", "last_token", "num_output", "num_prompt")

    def __init__(self, engine: int, num_prompt: int, arrival: float) -> None:
        self.engine = engine
        self.num_prompt = num_prompt
        self.arrival = arrival  # time.time(), as EngineCoreRequest.arrival_time
        self.first_token: float | None = None
        self.last_token = 0.0
        self.num_output = 0


class PluginMetricsRegistry(CollectorRegistry):
    """The registry a `register_metrics` plugin registers on. It remembers what was
    registered, so that with several API servers its prometheus-client metrics (whose
    values the multiprocess directory already holds) are not served twice."""

    def __init__(self) -> None:
        super().__init__()
        self.collectors: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Any) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


# Which way a message between the API server and an engine went.
MESSAGE_DIRECTIONS = ("to_engine", "from_engine")


class FrontendMetrics:
    """One API server's metrics: fed by its engine client, served by /metrics."""

    def __init__(
        self,
        model_name: str,
        num_engines: int = 1,
        max_model_len: int = 2048,
        num_kv_blocks: list[int] | None = None,
    ) -> None:
        """`num_kv_blocks`: each engine's, from its handshake."""
        self.model_name = model_name
        self.num_engines = num_engines
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV) or None
        # This process's metric objects. With a multiprocess directory their values live
        # there (prometheus-client decides when it is imported) and the scrape reads the
        # directory instead of this registry.
        self.registry = CollectorRegistry(auto_describe=True)
        self.plugin_registry = PluginMetricsRegistry()
        self._num_kv_blocks = list(num_kv_blocks or [0] * num_engines)
        self._timings: dict[str, _Timing] = {}
        labels = ["model_name", "engine"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=tuple(buckets))

        running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        request_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        request_generation = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        # Per engine, the labelled children (labels() costs a lookup per call).
        # Speculative decoding (vLLM's names; zero without it).
        spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ("position",),
        )
        self._engines = []
        for engine in range(num_engines):
            values = (model_name, str(engine))
            self._engines.append(
                _EngineMetrics(
                    running=running.labels(*values),
                    waiting=waiting.labels(*values),
                    kv_usage=kv_usage.labels(*values),
                    prefix_cache_queries=queries.labels(*values),
                    prefix_cache_hits=hits.labels(*values),
                    preemptions=preemptions.labels(*values),
                    prompt_tokens=prompt_tokens.labels(*values),
                    generation_tokens=generation_tokens.labels(*values),
                    success={why: success.labels(*values, why) for why in FINISH_REASONS},
                    ttft=ttft.labels(*values),
                    itl=itl.labels(*values),
                    e2e=e2e.labels(*values),
                    queue=queue.labels(*values),
                    request_prompt=request_prompt.labels(*values),
                    request_generation=request_generation.labels(*values),
                    spec_drafts=spec_drafts.labels(*values),
                    spec_draft_tokens=spec_draft_tokens.labels(*values),
                    spec_accepted=spec_accepted.labels(*values),
                )
            )
        # plugserve_* of earlier releases, summed over the engines.
        self._legacy = [
            (field, Counter(name, f"{doc} (All engines.)", registry=r))
            for name, field, doc in LEGACY_COUNTERS
        ]
        finished = Counter(
            "plugserve_engine_requests_finished",
            "Requests the engines finished, by finish reason.",
            ["reason"],
            registry=r,
        )
        self._finished = {reason: finished.labels(reason) for reason in FINISH_REASONS}
        assigned = Counter(
            "plugserve_engine_requests",
            "Requests sent to each engine (every API server's).",
            ["engine"],
            registry=r,
        )
        self._assigned = [assigned.labels(str(e)) for e in range(num_engines)]
        messages = Counter(
            "plugserve_engine_messages",
            "Messages between this API server and each engine, by direction.",
            ["engine", "direction"],
            registry=r,
        )
        message_bytes = Counter(
            "plugserve_engine_message_bytes",
            "Bytes of the messages between this API server and each engine, by direction.",
            ["engine", "direction"],
            registry=r,
        )
        self._messages = {
            (e, direction): (
                messages.labels(str(e), direction),
                message_bytes.labels(str(e), direction),
            )
            for e in range(num_engines)
            for direction in MESSAGE_DIRECTIONS
        }
        self._scrape_registry = CollectorRegistry(auto_describe=False)
        self._scrape_registry.register(_Exposition(self))

    # ------------------------------------------------------------------ the engines' figures

    def record_message(self, engine: int, direction: str, nbytes: int) -> None:
        """One message to or from `engine` (`direction`: one of MESSAGE_DIRECTIONS)."""
        count, size = self._messages[engine, direction]
        count.inc()
        size.inc(nbytes)

    def record_scheduler_stats(self, engine: int, stats: SchedulerStats) -> None:
        """One stats message of `engine`: gauges as they are, counters as increments."""
        m = self._engines[engine]
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.kv_usage.set(stats.kv_usage)
        if stats.prefix_cache_queries:
            m.prefix_cache_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            m.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            m.preemptions.inc(stats.num_preemptions)
        if stats.spec_num_drafts:
            m.spec_drafts.inc(stats.spec_num_drafts)
            m.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
            m.spec_accepted.inc(stats.spec_num_accepted_tokens)
            for position, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
                if n:
                    self._spec_accepted_per_pos.labels(
                        self.model_name, str(engine), str(position)
                    ).inc(n)
        for field, legacy in self._legacy:
            value = getattr(stats, field)
            if value:
                legacy.inc(value)
        for reason, n in stats.num_finished.items():
            if n and reason in self._finished:
                self._finished[reason].inc(n)

    # ------------------------------------------------------------------ requests

    def request_started(
        self, request_id: str, engine: int, num_prompt_tokens: int, arrival_time: float
    ) -> None:
        self._assigned[engine].inc()
        self._timings[request_id] = _Timing(engine, num_prompt_tokens, arrival_time)

    def request_output(self, request_id: str, output: EngineCoreOutput) -> None:
        """An engine output of a request in flight (before its finish, if it finishes)."""
        timing = self._timings.get(request_id)
        num_new = len(output.new_token_ids)
        if timing is None or not num_new:
            return
        now = time.time()
        m = self._engines[timing.engine]
        if timing.first_token is None:
            timing.first_token = now
            m.ttft.observe(now - timing.arrival)
            m.prompt_tokens.inc(timing.num_prompt)
            if output.queue_seconds is not None:
                m.queue.observe(output.queue_seconds)
        else:
            m.itl.observe(now - timing.last_token)
        timing.last_token = now
        timing.num_output += num_new
        m.generation_tokens.inc(num_new)

    def request_finished(self, request_id: str, reason: str) -> None:
        """The request is over: `reason` one of FINISH_REASONS (a client that went away
        is "abort", a stop string "stop"). A request that failed ("error") counts only
        by its reason."""
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        m = self._engines[timing.engine]
        counter = m.success.get(reason)
        if counter is not None:
            counter.inc()
        if reason == "error":
            return
        m.e2e.observe(time.time() - timing.arrival)
        m.request_prompt.observe(timing.num_prompt)
        m.request_generation.observe(timing.num_output)

    # ------------------------------------------------------------------ scrape

    def exposition(self) -> bytes:
        """Prometheus' text format: every API server's figures, and the plugins'."""
        return prometheus_client.generate_latest(self._scrape_registry)

    def _source(self) -> Iterable[Metric]:
        if self.multiprocess_dir is None:
            return self.registry.collect()
        return MultiProcessCollector(None, self.multiprocess_dir).collect()


class _EngineMetrics:
    def __init__(self, **children: Any) -> None:
        self.__dict__.update(children)


class _Exposition:
    """The one collector a scrape asks: this process's metrics (or every API server's,
    from the multiprocess directory), the plugserve_* gauges summed from the per-engine
    ones, and the plugins' collectors."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self.metrics
        per_engine: dict[str, dict[str, float]] = {}
        for family in metrics._source():
            if family.name in _SUMMED_GAUGES:
                per_engine[family.name] = {
                    s.labels.get("engine", "0"): s.value
                    for s in family.samples
                    if s.labels.get("model_name") == metrics.model_name
                }
            yield family
        yield from self._legacy_gauges(per_engine)
        for collector in metrics.plugin_registry.collectors:
            if metrics.multiprocess_dir is not None and isinstance(collector, MetricWrapperBase):
                continue  # its values are in the directory, served above
            yield from collector.collect()

    def _legacy_gauges(self, per_engine: dict[str, dict[str, float]]) -> Iterator[Metric]:
        engines = [str(e) for e in range(self.metrics.num_engines)]
        blocks = dict(zip(engines, self.metrics._num_kv_blocks, strict=True))
        usage = per_engine.get("vllm:kv_cache_usage_perc", {})
        free = {e: round(blocks[e] * (1.0 - usage.get(e, 0.0))) for e in engines}
        total_blocks = sum(blocks.values())
        total_free = sum(free.values())
        figures = (
            (
                "plugserve_num_requests_running",
                sum(per_engine.get("vllm:num_requests_running", {}).values()),
            ),
            (
                "plugserve_num_requests_waiting",
                sum(per_engine.get("vllm:num_requests_waiting", {}).values()),
            ),
            ("plugserve_kv_cache_usage", 1.0 - total_free / total_blocks if total_blocks else 0.0),
            ("plugserve_kv_cache_blocks", total_blocks),
            ("plugserve_kv_cache_free_blocks", total_free),
        )
        for name, value in figures:
            family = GaugeMetricFamily(
                name, "Summed over the engines (plugserve's name of earlier releases)."
            )
            family.add_metric([], value)
            yield family


_SUMMED_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)
