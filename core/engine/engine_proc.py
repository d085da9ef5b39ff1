"""The engine-core process: IO threads around a busy loop (phases 4 and 10 of
docs/request-path.md).

The input thread receives frames, decodes them and queues them. The busy loop drains the
input queue, steps the engine and hands each step's outputs on, and blocks on the input
queue when there is nothing to do, so an idle engine burns no core.

Who sends the outputs depends on where the forward pass runs. On a GPU an output thread
encodes and sends them while the busy loop goes on to the next step, so that work
overlaps the device's. On a CPU the forward pass keeps every core busy and there is no
such overlap to gain: an output thread only gets the GIL once the next forward pass
releases it, and then takes a core from it. There the busy loop sends each step's outputs
itself, before it prepares the next step, and the API server and its client handle them
while the engine's Python runs, which lowered the served c=1 ITL (docs/benchmarks-history.md,
"outputs sent from the busy loop").

Several API servers (clients) may share the engine. The channel says which client each
message came from; the busy loop remembers which client sent each request and answers
every output, PONG and refusal to that client only. The handshake and DEAD go to all.

Statistics travel with what the engine sends anyway (outputs, PONG): the scheduler's
gauges as they are, its counters as what changed since the previous stats message to any
client, so that each increment reaches one API server and their sum is the engine's
total (messages.stats_since). When figures changed but no message carried them (an abort,
a prefill chunk, going idle), the busy loop sends them alone: nothing has to ask. Every
`engine.log_stats_interval` seconds while busy it logs a line of throughput and state,
as vLLM does.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from plugserve import __version__
from plugserve.capabilities import supports_weight_read_probe
from plugserve.config import StackConfig
from plugserve.device import resolve_device
from plugserve.engine.core import EngineCore
from plugserve.engine.entrypoint import engine_process_name
from plugserve.engine.speculation import describe_acceptance
from plugserve.interfaces.transport import EngineChannel
from plugserve.logging_utils import configure_process_logging
from plugserve.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    OutputType,
    Pong,
    ReadWeights,
    RequestType,
    SchedulerStats,
    WeightRead,
    abort_decoder,
    encoder,
    int_decoder,
    read_weights_decoder,
    request_decoder,
    stats_since,
)
from plugserve.model_files import CheckpointError
from plugserve.plugins import get_registry

logger = logging.getLogger(__name__)

_STOP = object()
_BROADCAST = -1  # an output item for every client (DEAD)
# While busy, changed figures that no output carried (prefill chunks, steps waiting for a
# grammar) are sent alone at most this often; going idle, at once.
STATS_ONLY_INTERVAL_S = 0.1

# (message type, decoded payload, the client it came from)
_Input = tuple[bytes, Any, int]


def run_engine_core(config_json: str, addresses: dict[str, str], engine_index: int = 0) -> None:
    """What a spawned engine-core process runs (one per data-parallel rank), called by
    its spawn target, plugserve.engine.entrypoint.run_engine_core."""
    config = StackConfig.model_validate_json(config_json)
    config.engine.data_parallel_rank = engine_index
    dp_size = config.engine.data_parallel_size
    name = engine_process_name(engine_index, dp_size)
    configure_process_logging(name)
    try:
        import setproctitle

        setproctitle.setproctitle(f"plugserve::{name}")
    except ImportError:  # the title is a convenience for ps and top
        pass
    # The API server handles Ctrl-C and tells us to shut down; a terminal's SIGINT to
    # the whole group must not kill the engine mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    inputs: queue.Queue[_Input] = queue.Queue()
    _shut_down_on_sigterm(inputs)
    if dp_size > 1 and config.engine.num_threads is None:
        # Replicas share the host's cores rather than all fighting for every one.
        config.engine.num_threads = max(1, (os.cpu_count() or 1) // dp_size)
    registry = get_registry(config.disabled_plugins)
    transport = registry.build(
        "transport", config.stack.transport, config.plugin_options(config.stack.transport)
    )
    channel = transport.engine(addresses, engine_index)
    try:
        engine = EngineCore(config)
    except BaseException as exc:
        # A checkpoint the user must fix is reported once, in one line, by whoever
        # started the engine (from the DEAD message); anything else with its traceback.
        if not isinstance(exc, CheckpointError):
            logger.exception("engine failed to start")
        dead = EngineDead(engine_index=engine_index, error=_one_line(exc))
        channel.send_ready([OutputType.DEAD, encoder.encode(dead)])
        channel.close()
        sys.exit(1)
    info = engine.kv_cache_info
    ready = EngineReady(
        engine_index=engine_index,
        num_kv_blocks=info.num_blocks,
        block_size=info.block_size,
        dtype=info.dtype,
        max_model_len=info.max_model_len,
        version=__version__,
        pid=os.getpid(),
    )
    channel.send_ready([OutputType.READY, encoder.encode(ready)])
    num_clients = config.server.api_server_count
    EngineCoreProc(engine, channel, engine_index, num_clients, inputs).run()


def _exit_with_parent() -> None:
    """Leave at once when the parent is gone (the API server, or the launcher of several,
    killed with SIGKILL or crashed): nobody can reach an orphaned engine, which would
    hold its memory until rebooted."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not spawned by multiprocessing (run in-process by a test)
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("its parent (pid %s) is gone; the engine exits", parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="ParentWatch", daemon=True).start()


def _shut_down_on_sigterm(inputs: queue.Queue[_Input]) -> None:
    """SIGTERM (how a launcher of several API servers stops the engines it owns) is a
    SHUTDOWN message: the busy loop ends after its step and the engine exits 0. The
    handler itself does nothing, since it may interrupt the main thread anywhere (inside
    a queue's lock, say); the signal's wake-up byte is what a thread acts on."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    signal.set_wakeup_fd(write_fd)

    def watch() -> None:
        while os.read(read_fd, 1)[0] != signal.SIGTERM:
            pass
        logger.info("SIGTERM: shutting down")
        inputs.put((RequestType.SHUTDOWN, None, 0))

    threading.Thread(target=watch, name="SignalWatch", daemon=True).start()


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


class EngineCoreProc:
    def __init__(
        self,
        engine: EngineCore,
        channel: EngineChannel,
        engine_index: int = 0,
        num_clients: int = 1,
        input_queue: queue.Queue[_Input] | None = None,
        send_from_busy_loop: bool | None = None,
    ) -> None:
        """`send_from_busy_loop`: the busy loop sends every output itself, and there is
        no output thread; None: so where the engine's forward pass runs on the CPU."""
        self.engine = engine
        self.engine_index = engine_index
        self.channel = channel
        self.num_clients = num_clients
        self.input_queue: queue.Queue[_Input] = input_queue or queue.Queue()
        if send_from_busy_loop is None:
            send_from_busy_loop = resolve_device(engine.config.engine.device).type == "cpu"
        self.send_from_busy_loop = send_from_busy_loop
        # (message type, message, client or _BROADCAST), for the output thread
        self.output_queue: queue.Queue[Any] = queue.Queue()
        # The client (API server) that sent each unfinished request: its outputs go back
        # there. Only the busy loop touches it.
        self._client_of: dict[str, int] = {}
        self._running = True
        # The engine's figures as of the last stats message sent (to any client), and
        # whether one went out in this turn of the busy loop.
        self._reported = SchedulerStats()
        self._stats_sent = False
        self._stats_sent_at = 0.0
        self._num_pings = 0
        self._stats_log = _StatsLog(engine_index, engine.config.engine.log_stats_interval)

    def run(self) -> None:
        threading.Thread(target=self._input_thread, name="EngineInput", daemon=True).start()
        output_thread = None
        if not self.send_from_busy_loop:
            output_thread = threading.Thread(
                target=self._output_thread, name="EngineOutput", daemon=True
            )
            output_thread.start()
        exit_code = 0
        try:
            self._busy_loop()
        except BaseException as exc:
            logger.exception("engine core died")
            dead = EngineDead(engine_index=self.engine_index, error=_one_line(exc))
            try:
                self._output(OutputType.DEAD, dead, _BROADCAST)
            except Exception:  # what died may be the channel itself
                logger.exception("the clients could not be told")
            exit_code = 1
        finally:
            if output_thread is not None:
                self.output_queue.put(_STOP)
                output_thread.join(timeout=5)
            self.engine.shutdown()
            self.channel.close()
        if exit_code:
            sys.exit(exit_code)

    # ------------------------------------------------------------------ busy loop

    def _busy_loop(self) -> None:
        stats_log = self._stats_log
        while self._running:
            idle = not self.engine.has_requests()
            # Idle, wake up once more for the log line that ends a busy spell.
            self._drain_inputs(block=idle, timeout=stats_log.wait(idle))
            if not self._running:
                break
            self._stats_sent = False
            outputs, computed = self.engine.step()
            if outputs:
                self._emit(outputs)
            if not self._stats_sent:
                self._send_changed_stats()
            stats_log.after_turn(computed, self.engine.stats)

    def _send_changed_stats(self) -> None:
        """Figures that changed without an output to carry them (an abort, a prefill
        chunk, the step that goes idle) go alone, to any client: at once when the engine
        goes idle, at most every STATS_ONLY_INTERVAL_S while it is busy."""
        now = time.monotonic()
        busy = self.engine.has_requests()
        if busy and now - self._stats_sent_at < STATS_ONLY_INTERVAL_S:
            return
        if self._current_stats() != self._reported:
            self._send_outputs(0, [], self._stats_message())
            if self.send_from_busy_loop:
                self.engine.timer.count_output_time(time.monotonic() - now)

    def _current_stats(self) -> SchedulerStats:
        stats = self.engine.stats()
        stats.num_pings = self._num_pings
        return stats

    def _stats_message(self) -> SchedulerStats:
        """What a message carries: the gauges, and the counters since the last one."""
        now = self._current_stats()
        delta = stats_since(now, self._reported)
        self._reported = now
        self._stats_sent = True
        self._stats_sent_at = time.monotonic()
        return delta

    def _drain_inputs(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = self.input_queue.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: bytes, payload: Any, client: int) -> None:
        if kind == RequestType.ADD:
            self._add(payload, client)
        elif kind == RequestType.ABORT:
            # Aborts come from the client, which already finished the request: no
            # output. A client aborts only its own requests.
            mine = [rid for rid in payload if self._client_of.get(rid) == client]
            for request_id in mine:
                del self._client_of[request_id]
            self.engine.abort_requests(mine)
        elif kind == RequestType.PING:
            # A worker that died while the engine was idle fails the ping, not a request.
            self.engine.executor.check_health()
            self._num_pings += 1
            pong = Pong(payload, self.engine_index, self._stats_message())
            self._output(OutputType.PONG, pong, client)
        elif kind == RequestType.READ_WEIGHTS:
            self._output(OutputType.WEIGHT_READ, self._read_weights(payload), client)
        elif kind == RequestType.SHUTDOWN:
            self._running = False
        elif kind == b"__error__":
            raise payload

    def _read_weights(self, probe: ReadWeights) -> WeightRead:
        # Between two steps, so running requests wait for it: a benchmark asks while idle.
        answer = WeightRead(nonce=probe.nonce, engine_index=self.engine_index)
        executor = self.engine.executor
        if not supports_weight_read_probe(executor):
            name = self.engine.config.stack.executor
            answer.error = f"executor '{name}' cannot measure how fast its weights read"
            return answer
        try:
            answer.weight_bytes, answer.bytes_per_second = executor.measure_weight_read(
                probe.seconds
            )
        except ValueError as exc:
            answer.error = str(exc)
        return answer

    def _add(self, request: EngineCoreRequest, client: int) -> None:
        request_id = request.request_id
        if request_id in self._client_of:
            # Another API server's request has this id (ids are random, so this is a
            # bug or a collision): refusing it keeps that request's outputs where they go.
            self._refuse(request_id, client, f"request id {request_id!r} is already in use")
            return
        try:
            self.engine.add_request(request)
        except Exception as exc:
            # Confined to this request: it finishes with the error, the rest go on.
            logger.warning("request %s refused: %s", request_id, exc)
            self._refuse(request_id, client, _one_line(exc))
            return
        self._client_of[request_id] = client

    def _refuse(self, request_id: str, client: int, error: str) -> None:
        refusal = EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason="error", error=error
        )
        self._send_outputs(client, [refusal], self._stats_message())

    def _emit(self, outputs: list[EngineCoreOutput]) -> None:
        """Send one step's outputs, one message per client that has some."""
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs:
            request_id = output.request_id
            if output.finished:
                client = self._client_of.pop(request_id, None)
            else:
                client = self._client_of.get(request_id)
            if client is None:
                logger.warning("output for request %s, which no client sent", request_id)
                continue
            by_client.setdefault(client, []).append(output)
        if not by_client:
            return
        started = time.perf_counter()
        # The counters go with the first message only: each increment to one client.
        stats: SchedulerStats | None = self._stats_message()
        for client, client_outputs in by_client.items():
            self._send_outputs(client, client_outputs, stats)
            stats = None
        if self.send_from_busy_loop:
            self.engine.timer.count_output_time(time.perf_counter() - started)

    def _send_outputs(
        self, client: int, outputs: list[EngineCoreOutput], stats: SchedulerStats | None
    ) -> None:
        batch = EngineCoreOutputs(
            outputs=outputs, scheduler_stats=stats, engine_index=self.engine_index
        )
        self._output(OutputType.OUTPUTS, batch, client)

    def _output(self, kind: bytes, message: Any, client: int) -> None:
        """Send a message now (send_from_busy_loop) or leave it to the output thread."""
        if self.send_from_busy_loop:
            self._send(kind, message, client)
        else:
            self.output_queue.put((kind, message, client))

    def _send(self, kind: bytes, message: Any, client: int) -> None:
        frames = [kind, encoder.encode(message)]
        for each in range(self.num_clients) if client == _BROADCAST else (client,):
            self.channel.send(frames, each)

    # ------------------------------------------------------------------ IO threads

    def _input_thread(self) -> None:
        decoders = {
            RequestType.ADD: request_decoder,
            RequestType.ABORT: abort_decoder,
            RequestType.PING: int_decoder,
            RequestType.READ_WEIGHTS: read_weights_decoder,
        }
        try:
            while True:
                received = self.channel.recv(timeout=None)
                if received is None:
                    continue
                client, frames = received
                kind = bytes(frames[0])
                decoder = decoders.get(kind)
                payload = decoder.decode(frames[1]) if decoder is not None else None
                self.input_queue.put((kind, payload, client))
                if kind == RequestType.SHUTDOWN:
                    return
        except Exception as exc:  # the busy loop must learn that its inputs are gone
            self.input_queue.put((b"__error__", exc, 0))

    def _output_thread(self) -> None:
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                return
            try:
                self._send(*item)
            except Exception as exc:
                # Outputs can no longer leave: the busy loop must fail loudly (the
                # frontend sees the process exit) rather than generate into the void.
                logger.exception("engine output could not be sent")
                self.input_queue.put((b"__error__", exc, 0))
                return


class _StatsLog:
    """vLLM's periodic engine line: every `interval` seconds while the engine is busy (and
    once more when a busy spell ends), its prompt and generation throughput over the
    interval, running and waiting requests, KV cache usage and prefix-cache hit rate.
    `interval` 0: never."""

    def __init__(self, engine_index: int, interval: float) -> None:
        self.engine_index = engine_index
        self.interval = interval
        self._last = SchedulerStats()  # the figures at the last line
        self._last_at = time.monotonic()
        self._unlogged = False  # tokens were computed since the last line

    def wait(self, idle: bool) -> float | None:
        """How long an idle busy loop may block: until the line that ends a busy spell."""
        if not idle or not self.interval or not self._unlogged:
            return None
        return max(0.0, self._last_at + self.interval - time.monotonic())

    def after_turn(self, computed: bool, stats: Callable[[], SchedulerStats]) -> None:
        """After a turn of the busy loop (`computed`: its step computed tokens)."""
        if not self.interval:
            return
        now = time.monotonic()
        if computed and not self._unlogged:  # a busy spell begins: so does the interval
            self._unlogged = True
            self._last_at = now
        if not self._unlogged or now - self._last_at < self.interval:
            return
        current = stats()
        elapsed = now - self._last_at
        last = self._last
        queries = current.prefix_cache_queries - last.prefix_cache_queries
        hits = current.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
            "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.engine_index,
            (current.num_prompt_tokens - last.num_prompt_tokens) / elapsed,
            (current.num_generated_tokens - last.num_generated_tokens) / elapsed,
            current.num_running,
            current.num_waiting,
            current.kv_usage * 100,
            100 * hits / queries if queries else 0.0,
        )
        if spec_line := describe_acceptance(current, last):
            logger.info("Engine %03d: %s", self.engine_index, spec_line)
        self._last = current
        self._last_at = now
        self._unlogged = current.num_running + current.num_waiting > 0
