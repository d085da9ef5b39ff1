"""AsyncEngineClient: the API server's handle on the engine-core processes.

It opens this API server's channel to every engine, has the engines started (spawned
here with one API server, by the launcher with several: see engines.py), waits for
their handshakes, and then runs one output-handler task for every request: engine
outputs go to the OutputProcessor (output_processor.py) in chunks, yielding to the event
loop between chunks, and the requests a stop string ended there are sent back as aborts.
New requests go to the least loaded engine that serves (engine_fleet.py).

With data parallelism an engine that dies takes only its own requests along: they fail
with its error (503), no new request goes to it, /health says the server is degraded,
and the other engines serve on. The server is dead once every engine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from plugserve.config import StackConfig
from plugserve.datatypes import PooledTensor, RequestDelta
from plugserve.engine.entrypoint import engine_process_name
from plugserve.frontend.engine_fleet import EngineFleet
from plugserve.frontend.engines import EngineSupervision
from plugserve.frontend.metrics import FrontendMetrics
from plugserve.frontend.output_processor import OutputProcessor
from plugserve.frontend.request_state import EngineDeadError
from plugserve.interfaces.transport import ClientChannel
from plugserve.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    OutputType,
    ReadWeights,
    RequestType,
    SchedulerStats,
    WeightRead,
    dead_decoder,
    encoder,
    outputs_decoder,
    pong_decoder,
    ready_decoder,
    weight_read_decoder,
)
from plugserve.plugins import get_registry
from plugserve.pooling_params import PoolingParams
from plugserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OUTPUT_CHUNK_SIZE = 64  # outputs processed before yielding to the event loop
# For the DEAD message of an engine whose exit was seen first, while starting or serving.
LAST_WORDS_TIMEOUT_S = 1.0


class AsyncEngineClient:
    def __init__(
        self,
        config: StackConfig,
        *,
        addresses: dict[str, str],
        engines: EngineSupervision,
        client_index: int = 0,
        on_engine_dead: Callable[[str], None] | None = None,
    ) -> None:
        """`addresses` join the engines to every API server (`transport_addresses`);
        this one is client number `client_index`. The tokenizer comes with
        `use_tokenizer`, before the first request."""
        self.config = config
        self.eos_token_id: int | None = None
        self.on_engine_dead = on_engine_dead
        self.client_index = client_index
        self._addresses = addresses
        self._engines = engines
        registry = get_registry(config.disabled_plugins)
        stack = config.stack
        self._transport = registry.build(
            "transport", stack.transport, config.plugin_options(stack.transport)
        )
        self.num_engines = config.engine.data_parallel_size
        self._fleet = EngineFleet(self.num_engines)
        self._outputs = OutputProcessor(self._fleet, registry.get("detokenizer", stack.detokenizer))
        # Answers awaited, by nonce: (the engine asked, its future).
        self._pongs: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._weight_reads: dict[int, tuple[int, asyncio.Future[WeightRead]]] = {}
        self._nonces = itertools.count()
        self._channel: ClientChannel | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._engines_gone: asyncio.Future[str] | None = None
        self.readies: list[EngineReady] = []
        # This API server's Prometheus metrics, made once the engines have said their
        # max_model_len (the token histograms' buckets go up to it).
        self.metrics: FrontendMetrics | None = None
        self.dead_reason: str | None = None
        self._last_words: list[asyncio.Event] = []  # set by each engine's DEAD
        self._shut_down = False

    # ------------------------------------------------------------------ life cycle

    def use_tokenizer(self, tokenizer: Any, eos_token_id: int | None) -> None:
        """The renderer's tokenizer, which detokenizes the outputs, and its EOS id."""
        self._outputs.tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    async def start(self, timeout: float = 600.0) -> EngineReady:
        """Open the channel, have the engines started and wait for every handshake;
        raise EngineDeadError with an engine's own error if one dies while starting."""
        self._channel = self._transport.client(self._addresses, self.client_index)
        self._engines_gone = asyncio.get_running_loop().create_future()
        self._last_words = [asyncio.Event() for _ in range(self.num_engines)]
        self._engines.start()
        self._engines.watch(self._on_engine_gone)
        try:
            for _ in range(self.num_engines):
                self.readies.append(await self._next_handshake(timeout))
        except EngineDeadError as exc:
            self.dead_reason = str(exc)  # nothing to shut down in order
            await self._engines.stop(asked=False)
            raise
        self.readies.sort(key=lambda r: r.engine_index)
        self.metrics = FrontendMetrics(
            self.config.server.served_model_name or self.config.model,
            num_engines=self.num_engines,
            max_model_len=self.readies[0].max_model_len,
            num_kv_blocks=[ready.num_kv_blocks for ready in self.readies],
        )
        self._outputs.metrics = self.metrics
        self._tasks.append(asyncio.create_task(self._output_handler(), name="output-handler"))
        for ready in self.readies:
            logger.info(
                "engine core %d ready (pid %d): %d KV blocks of %d, %s, max_model_len %d",
                ready.engine_index,
                ready.pid,
                ready.num_kv_blocks,
                ready.block_size,
                ready.dtype,
                ready.max_model_len,
            )
        return self.readies[0]

    def _on_engine_gone(self, engine: int, reason: str) -> None:
        assert self._engines_gone is not None
        if len(self.readies) < self.num_engines:  # still starting: the start fails
            if not self._engines_gone.done():
                self._engines_gone.set_result(reason)
            return
        if self._fleet.serves(engine):
            self._fleet.leaving[engine] = reason
            retire = self._retire_after_last_words(engine, reason)
            self._tasks.append(asyncio.ensure_future(retire))

    async def _retire_after_last_words(self, engine: int, reason: str) -> None:
        """An engine that fails sends why (DEAD) and then exits, and its exit can reach us
        first: its requests in flight wait a moment for those last words, which name the
        cause; nothing new is sent to it meanwhile."""
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._last_words[engine].wait(), LAST_WORDS_TIMEOUT_S)
        self._retire(engine, reason)

    def _retire(self, engine: int, reason: str) -> None:
        """Engine `engine` is out of service: its requests fail with `reason`; the others
        serve on, and when it was the last, the whole client is dead."""
        if engine in self._fleet.retired or self.dead_reason is not None:
            return
        self._fleet.retire(engine, reason)
        if len(self._fleet.retired) == self.num_engines:
            self._mark_dead(reason)
            return
        serving = self.num_engines - len(self._fleet.retired)
        logger.error("%s; %d of %d engines serve on", reason, serving, self.num_engines)
        error = EngineDeadError(reason)
        self._outputs.fail(error, engine)
        for waiting in (self._pongs, self._weight_reads):
            for asked, future in waiting.values():
                if asked == engine and not future.done():
                    future.set_exception(error)
        if self.metrics is not None:
            self.metrics.record_scheduler_stats(engine, SchedulerStats())

    @property
    def _refusal(self) -> str | None:
        """Why nothing more can be sent: the engines are dead, or the last one serving
        has exited."""
        return self.dead_reason or self._fleet.all_gone

    @property
    def engines_out_of_service(self) -> dict[int, str]:
        """The engines that exited or failed, with why (empty while all serve)."""
        return dict(self._fleet.leaving)

    async def _next_handshake(self, timeout: float) -> EngineReady:
        assert self._channel is not None and self._engines_gone is not None
        ready_task = asyncio.ensure_future(self._channel.wait_ready(timeout))
        done, _ = await asyncio.wait(
            {ready_task, self._engines_gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready_task not in done and self._engines_gone.done():
            # An engine that fails while loading says why (DEAD) before it exits; its
            # sentinel may still wake us first.
            done, _ = await asyncio.wait({ready_task}, timeout=LAST_WORDS_TIMEOUT_S)
        if ready_task not in done:
            ready_task.cancel()
            if self._engines_gone.done():
                raise EngineDeadError(f"while starting, {self._engines_gone.result()}")
            raise EngineDeadError(f"the engine core did not start within {timeout:.0f} s")
        kind, payload = ready_task.result()
        if bytes(kind) == OutputType.DEAD:
            raise EngineDeadError(
                f"the engine core failed to start: {dead_decoder.decode(payload).error}"
            )
        return ready_decoder.decode(payload)

    @property
    def ready(self) -> EngineReady | None:
        """The first engine's handshake (every engine serves the same model and limits)."""
        return self.readies[0] if self.readies else None

    @property
    def stats(self) -> SchedulerStats:
        """Scheduler figures summed over the engines, as of their latest message to this
        API server; its counters count what the engines reported to this API server
        only (with several, /metrics sums them over every API server)."""
        return self._fleet.summed_stats()

    async def shutdown(self) -> None:
        """Stop listening; stop the engines if this client owns them. Idempotent (the
        app's lifespan and the launcher both call it)."""
        if self._shut_down:
            return
        self._shut_down = True
        for task in self._tasks:
            task.cancel()
        owns = self._engines.owns_engines
        asked = owns and self.dead_reason is None and self._channel is not None
        if asked:
            for index in self._fleet.serving():
                with contextlib.suppress(Exception):  # it is going away either way
                    await asyncio.wait_for(self._send([RequestType.SHUTDOWN, b""], index), 2)
        await self._engines.stop(asked=asked)
        if self._channel is not None:
            self._channel.close()

    @property
    def is_dead(self) -> bool:
        return self._refusal is not None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        self._outputs.fail(error)
        for _, future in [*self._pongs.values(), *self._weight_reads.values()]:
            if not future.done():
                future.set_exception(error)
        if self.on_engine_dead is not None:
            self.on_engine_dead(reason)

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Submit one request and yield its deltas until it finishes. Leaving the
        iteration early (a client disconnect cancels the handler) aborts it."""
        arrival_time = arrival_time or time.time()
        self._raise_if_refused()
        state = self._outputs.open(
            request_id, prompt_token_ids, params, arrival_time, detokenize=True
        )
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
        )
        try:
            await self._send([RequestType.ADD, encoder.encode(request)], state.engine)
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.finished and self._refusal is None:
                await self.abort([request_id])

    async def encode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        *,
        priority: int = 0,
    ) -> PooledTensor:
        """Submit one pooling request and return its pooled output. Cancelling the wait
        (a client disconnect) aborts it."""
        arrival_time = time.time()
        self._raise_if_refused()
        state = self._outputs.open(
            request_id,
            prompt_token_ids,
            SamplingParams(max_tokens=1),
            arrival_time,
            detokenize=False,
        )
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=state.params,
            arrival_time=arrival_time,
            priority=priority,
            pooling_params=params,
        )
        try:
            await self._send([RequestType.ADD, encoder.encode(request)], state.engine)
            item = await state.queue.get()
        finally:
            if not state.finished and self._refusal is None:
                await self.abort([request_id])
        if isinstance(item, BaseException):
            raise item
        assert item.pooled is not None
        return item.pooled

    def _raise_if_refused(self) -> None:
        """EngineDeadError if nothing more can be sent (see _refusal)."""
        if (refusal := self._refusal) is not None:
            raise EngineDeadError(refusal)

    async def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """Abort requests in flight; `reason` for the metrics: "abort" (the client went
        away), or "stop" (a stop string ended it here)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            state = self._outputs.states.get(request_id)
            if state is not None:
                self._outputs.forget(state, reason)
                by_engine.setdefault(state.engine, []).append(request_id)
        for engine, ids in by_engine.items():
            if self._fleet.serves(engine):  # a gone engine has nothing left to free
                await self._send([RequestType.ABORT, encoder.encode(ids)], engine)

    async def check_health(self, timeout: float) -> dict[int, str]:
        """A round trip through the transport to every serving engine's busy loop.
        Returns the engines out of service, with why (empty while all serve). Raises
        EngineDeadError if none serves, TimeoutError if one does not answer."""
        self._raise_if_refused()
        loop = asyncio.get_running_loop()
        asked = {next(self._nonces): engine for engine in self._fleet.serving()}
        futures: dict[int, asyncio.Future[None]] = {n: loop.create_future() for n in asked}
        self._pongs.update({n: (asked[n], futures[n]) for n in asked})
        try:
            for nonce, engine in asked.items():
                await self._send([RequestType.PING, encoder.encode(nonce)], engine)
            answers = asyncio.gather(*futures.values(), return_exceptions=True)
            for answer in await asyncio.wait_for(answers, timeout):
                # An engine that died meanwhile is out of service now, not a failure.
                if isinstance(answer, BaseException) and not isinstance(answer, EngineDeadError):
                    raise answer
        finally:
            for nonce in asked:
                self._pongs.pop(nonce, None)
        self._raise_if_refused()
        return self.engines_out_of_service

    async def measure_weight_read(
        self, seconds: float, timeout: float, engine: int = 0
    ) -> WeightRead:
        """How fast engine `engine` reads its own weights now, measured for `seconds`
        between two of its steps (WeightRead.error says why it cannot). TimeoutError if
        the answer takes longer than `timeout`."""
        self._raise_if_refused()
        if not 0 <= engine < self.num_engines:
            raise ValueError(f"no engine {engine}: there are {self.num_engines}")
        if not self._fleet.serves(engine):
            raise EngineDeadError(self._fleet.leaving[engine])
        nonce = next(self._nonces)
        future: asyncio.Future[WeightRead] = asyncio.get_running_loop().create_future()
        self._weight_reads[nonce] = (engine, future)
        try:
            probe = encoder.encode(ReadWeights(nonce, seconds))
            await self._send([RequestType.READ_WEIGHTS, probe], engine)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._weight_reads.pop(nonce, None)

    async def _send(self, frames: list[bytes], engine: int = 0) -> None:
        assert self._channel is not None, "start() the client first"
        await self._channel.send(frames, engine)
        if self.metrics is not None:
            self.metrics.record_message(engine, "to_engine", sum(len(f) for f in frames))

    # ------------------------------------------------------------------ outputs

    async def _output_handler(self) -> None:
        assert self._channel is not None
        try:
            while True:
                kind, payload = await self._channel.recv()
                kind = bytes(kind)
                nbytes = len(kind) + memoryview(payload).nbytes
                if kind == OutputType.OUTPUTS:
                    batch = outputs_decoder.decode(payload)
                    self._received(batch.engine_index, nbytes)
                    if batch.scheduler_stats is not None:
                        self._record_stats(batch.engine_index, batch.scheduler_stats)
                    await self._process_outputs(batch.outputs)
                elif kind == OutputType.PONG:
                    pong = pong_decoder.decode(payload)
                    self._received(pong.engine_index, nbytes)
                    self._record_stats(pong.engine_index, pong.stats)
                    _, future = self._pongs.get(pong.nonce, (None, None))
                    if future is not None and not future.done():
                        future.set_result(None)
                elif kind == OutputType.WEIGHT_READ:
                    read = weight_read_decoder.decode(payload)
                    self._received(read.engine_index, nbytes)
                    _, waiter = self._weight_reads.get(read.nonce, (None, None))
                    if waiter is not None and not waiter.done():
                        waiter.set_result(read)
                elif kind == OutputType.DEAD:
                    dead = dead_decoder.decode(payload)
                    self._last_words[dead.engine_index].set()
                    self._retire(dead.engine_index, self._failed(dead.engine_index, dead.error))
                    if self.dead_reason is not None:
                        return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("output handler failed")
            self._mark_dead(f"lost the engine's outputs: {exc}")

    def _received(self, engine: int, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.record_message(engine, "from_engine", nbytes)

    def _failed(self, engine: int, error: str) -> str:
        if self.num_engines == 1:
            return f"the engine core failed: {error}"
        return f"the engine core {engine_process_name(engine, self.num_engines)} failed: {error}"

    def _record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self._fleet.record_stats(engine, stats)
        if self.metrics is not None:
            self.metrics.record_scheduler_stats(engine, stats)

    async def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
            to_abort: list[str] = []
            for output in outputs[start : start + OUTPUT_CHUNK_SIZE]:
                if self._outputs.apply(output):
                    to_abort.append(output.request_id)
            if to_abort:
                # Stop strings end requests here; the engine must free them too.
                await self.abort(to_abort, reason="stop")
            if start + OUTPUT_CHUNK_SIZE < len(outputs):
                await asyncio.sleep(0)
