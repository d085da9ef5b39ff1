"""AsyncEngineClient: the API server's handle on the engine-core process.

It spawns the engine, waits for its handshake, and then runs one output-handler task
for every request: engine outputs are detokenized in chunks (yielding to the event loop
between chunks), stop strings are checked here and sent back as aborts, and each
request's deltas land on that request's own queue. A request's state is registered
before the request is sent, so no output can arrive for an unknown request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from plugserve.config import StackConfig
from plugserve.engine.engine_proc import run_engine_core
from plugserve.interfaces import ClientChannel, Detokenizer
from plugserve.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    OutputType,
    RequestType,
    SchedulerStats,
    dead_decoder,
    encoder,
    outputs_decoder,
    pong_decoder,
    ready_decoder,
)
from plugserve.plugins import get_registry
from plugserve.sampling_params import SamplingParams
from plugserve.worker.model_runner_output import Logprobs

logger = logging.getLogger(__name__)

OUTPUT_CHUNK_SIZE = 64  # outputs processed before yielding to the event loop


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more will be generated."""


class RequestError(RuntimeError):
    """The engine finished this request with an error; others are unaffected."""


@dataclass
class RequestDelta:
    """What one engine step added to one request, as the serving layer streams it."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, including this delta
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: Detokenizer
    queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    finished: bool = False


class AsyncEngineClient:
    def __init__(
        self,
        config: StackConfig,
        *,
        tokenizer: Any,
        eos_token_id: int | None,
        on_engine_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.on_engine_dead = on_engine_dead
        registry = get_registry(config.disabled_plugins)
        stack = config.stack
        self._transport = registry.build(
            "transport", stack.transport, config.plugin_options(stack.transport)
        )
        self._detokenizer_cls = registry.get("detokenizer", stack.detokenizer)
        self._states: dict[str, RequestState] = {}
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._nonces = itertools.count()
        self._channel: ClientChannel | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.ready: EngineReady | None = None
        self.stats = SchedulerStats()
        self.dead_reason: str | None = None

    # ------------------------------------------------------------------ life cycle

    async def start(self, timeout: float = 600.0) -> EngineReady:
        """Spawn the engine core and wait for its handshake; raise EngineDeadError with
        the engine's own error if it dies while starting."""
        addresses = self._transport.addresses()
        self._channel = self._transport.client(addresses)
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=run_engine_core,
            args=(self.config.model_dump_json(), addresses),
            name="EngineCore",
        )
        self._process.start()
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._process.sentinel, lambda: exited.done() or exited.set_result(None))
        ready_task = asyncio.ensure_future(self._channel.wait_ready(timeout))
        done, _ = await asyncio.wait(
            {ready_task, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if ready_task not in done:
            ready_task.cancel()
            await self._stop_process()
            reason = (
                "exited while starting"
                if exited.done()
                else f"did not start within {timeout:.0f} s"
            )
            raise EngineDeadError(f"the engine core {reason} (exit code {self._process.exitcode})")
        kind, payload = ready_task.result()
        if bytes(kind) == OutputType.DEAD:
            await self._stop_process()
            raise EngineDeadError(
                f"the engine core failed to start: {dead_decoder.decode(payload).error}"
            )
        self.ready = ready_decoder.decode(payload)
        loop.remove_reader(self._process.sentinel)
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._tasks.append(asyncio.create_task(self._output_handler(), name="output-handler"))
        logger.info(
            "engine core ready (pid %d): %d KV blocks of %d, %s, max_model_len %d",
            self.ready.pid,
            self.ready.num_kv_blocks,
            self.ready.block_size,
            self.ready.dtype,
            self.ready.max_model_len,
        )
        return self.ready

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive() and self.dead_reason is None:
            with contextlib.suppress(Exception):  # the engine is going away either way
                await asyncio.wait_for(self._send([RequestType.SHUTDOWN, b""]), 2)
        await self._stop_process()
        if self._channel is not None:
            self._channel.close()

    async def _stop_process(self) -> None:
        process = self._process
        if process is None:
            return
        asyncio.get_running_loop().remove_reader(process.sentinel)
        for stop in (None, process.terminate, process.kill):
            if stop is not None:
                stop()
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5)
            if not process.is_alive():
                return

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def _on_process_exit(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join(0)
        self._mark_dead(f"the engine core exited unexpectedly (exit code {self._process.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        for state in self._states.values():
            state.queue.put_nowait(error)
        self._states.clear()
        for future in self._pongs.values():
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
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(
            request_id=request_id,
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            detokenizer=self._detokenizer_cls(
                tokenizer=self.tokenizer, prompt_token_ids=prompt_token_ids, params=params
            ),
        )
        self._states[request_id] = state  # before sending: outputs may come back at once
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time or time.time(),
            priority=priority,
        )
        try:
            await self._send([RequestType.ADD, encoder.encode(request)])
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.finished:
                state.finished = True
                self._states.pop(request_id, None)
                if self.dead_reason is None:
                    await self.abort([request_id])

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                state.finished = True
        await self._send([RequestType.ABORT, encoder.encode(request_ids)])

    async def check_health(self, timeout: float) -> None:
        """A round trip through the transport to the engine's busy loop. Raises
        EngineDeadError if the engine is gone, TimeoutError if it does not answer."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        nonce = next(self._nonces)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = future
        try:
            await self._send([RequestType.PING, encoder.encode(nonce)])
            await asyncio.wait_for(future, timeout)
        finally:
            self._pongs.pop(nonce, None)

    async def _send(self, frames: list[bytes]) -> None:
        assert self._channel is not None, "start() the client first"
        await self._channel.send(frames)

    # ------------------------------------------------------------------ outputs

    async def _output_handler(self) -> None:
        assert self._channel is not None
        try:
            while True:
                kind, payload = await self._channel.recv()
                kind = bytes(kind)
                if kind == OutputType.OUTPUTS:
                    batch = outputs_decoder.decode(payload)
                    if batch.scheduler_stats is not None:
                        self.stats = batch.scheduler_stats
                    await self._process_outputs(batch.outputs)
                elif kind == OutputType.PONG:
                    pong = pong_decoder.decode(payload)
                    self.stats = pong.stats
                    future = self._pongs.get(pong.nonce)
                    if future is not None and not future.done():
                        future.set_result(None)
                elif kind == OutputType.DEAD:
                    self._mark_dead(f"the engine core failed: {dead_decoder.decode(payload).error}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("output handler failed")
            self._mark_dead(f"lost the engine's outputs: {exc}")

    async def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
            to_abort = []
            for output in outputs[start : start + OUTPUT_CHUNK_SIZE]:
                state = self._states.get(output.request_id)
                if state is None:
                    continue  # aborted on this side while the engine was stepping
                if self._apply(state, output):
                    to_abort.append(output.request_id)
            if to_abort:
                # Stop strings end requests here; the engine must free them too.
                await self._send([RequestType.ABORT, encoder.encode(to_abort)])
            if start + OUTPUT_CHUNK_SIZE < len(outputs):
                await asyncio.sleep(0)

    def _apply(self, state: RequestState, output: EngineCoreOutput) -> bool:
        """Detokenize one output into a delta; True if a stop string ended the request."""
        if output.error is not None:
            state.finished = True
            del self._states[state.request_id]
            state.queue.put_nowait(RequestError(output.error))
            return False
        detok = state.detokenizer
        state.num_output_tokens += len(output.new_token_ids)
        text_ids = output.new_token_ids
        if output.finish_reason == "stop" and not state.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the EOS or stop token is not part of the text
        text = detok.update(text_ids)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        stopped_here = detok.stop_reason is not None and finish_reason is None
        if detok.stop_reason is not None:
            finish_reason, stop_reason = "stop", detok.stop_reason
        elif finish_reason is not None:
            text += detok.flush()
        if finish_reason is not None:
            state.finished = True
            del self._states[state.request_id]
        state.queue.put_nowait(
            RequestDelta(
                text=text,
                token_ids=output.new_token_ids,
                logprobs=output.new_logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_prompt_tokens=state.num_prompt_tokens,
                num_output_tokens=state.num_output_tokens,
                num_cached_tokens=output.num_cached_tokens,
            )
        )
        return stopped_here
