"""StructuredOutputManager: the engine side of structured output.

It owns the stack's structured-output backend (`stack.structured_output`), built on the
first constrained request, never before: an engine that serves no constrained request
loads no tokenizer for it. Compilation runs on a small thread pool, off the busy loop:
the scheduler parks a constrained request in WAITING_FOR_GRAMMAR with the compilation's
Future and lets it join the waiting queue once its grammar is ready, while every other
request goes on being scheduled. Building the backend itself (the tokenizer, the
backend's own vocabulary index) happens on that pool too, within the first compilation.

Each step, between `execute_model(non_block=True)` and `sample_tokens`, the engine asks
for the batch's bitmask: one row per constrained request that samples this step, filled
by its grammar (layout: datatypes.GrammarOutput).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, Request
from plugserve.generation_defaults import GenerationDefaults
from plugserve.interfaces.structured_output import Grammar, StructuredOutputBackend
from plugserve.model_files import load_tokenizer, resolve_model_path
from plugserve.plugins import PluginRegistry, get_registry
from plugserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled constraints kept; the least recently used is dropped past this.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(
        self,
        config: StackConfig,
        *,
        registry: PluginRegistry | None = None,
        max_workers: int = 2,
    ) -> None:
        self._config = config
        self._registry = registry or get_registry(config.disabled_plugins)
        # Threads start on the first submit only.
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="plugserve-grammar")
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.vocab_size = 0  # the model's logits width, known once the backend is built
        self._bitmask: torch.Tensor | None = None  # reused: [rows, ceil(vocab / 32)] int32
        # Compiled constraints by StructuredOutputsParams.key, least recently used first.
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (cache misses)

    # ------------------------------------------------------------------ compilation

    def submit(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """Compile `spec` on the pool; the Future raises ValueError for a bad constraint."""
        return self._pool.submit(self._compile, spec)

    def _compile(self, spec: StructuredOutputsParams) -> Grammar:
        """A request's Grammar: over the cached compiled constraint, or a fresh
        compilation (two requests racing on one constraint may both compile it)."""
        backend = self.backend()
        key = spec.key
        with self._cache_lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = backend.compile(spec)
            with self._cache_lock:
                self._compiled[key] = compiled
                self.num_compiled += 1
                while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return backend.grammar(compiled)

    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._build_backend()
            return self._backend

    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use (by the backend, or by a reasoning
        whose end marker is found in the text)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(resolve_model_path(self._config.model))
            return self._tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer().decode(token_ids)

    def _build_backend(self) -> StructuredOutputBackend:
        model_path = resolve_model_path(self._config.model)
        tokenizer = self.tokenizer()
        vocab_size = max(model_vocab_size(self._config), len(tokenizer))
        # The tokens that end the model's output: the tokenizer's EOS and every EOS id of
        # generation_config.json (a chat model's end of turn among them).
        eos = tokenizer.eos_token_id
        extra = GenerationDefaults.load(model_path, eos, use_sampling=False).extra_eos_token_ids
        stop_ids = [*([int(eos)] if eos is not None else []), *extra]
        name = self._config.stack.structured_output
        backend = self._registry.build(
            "structured_output",
            name,
            self._config.plugin_options(name),
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            stop_token_ids=stop_ids,
        )
        self.vocab_size = vocab_size
        logger.info(
            "structured output: %s backend ready (vocabulary %d, stop ids %s)",
            name,
            vocab_size,
            stop_ids,
        )
        return backend

    # ------------------------------------------------------------------ each step

    def grammar_output(
        self, requests: Sequence[Request], drafts: Mapping[str, list[int]] | None = None
    ) -> GrammarOutput:
        """The bitmask of the given requests: one row each, or, for a request with draft
        tokens to verify (speculative decoding), one row per draft position plus one, in
        order (its grammar advanced through the drafts before each row, then rolled back;
        the scheduler only schedules drafts the grammar accepts). The row of a request
        whose thinking budget is forcing its end marker allows that marker's next id
        only; the others' rows are filled by their grammars."""
        owners: list[Request] = []
        for request in requests:
            owners += [request] * (1 + len(drafts.get(request.request_id, ())) if drafts else 1)
        num_rows = len(owners)
        forced = [r.forced_token_ids[0] for r in requests if r.forced_token_ids]
        # Before any grammar was compiled the vocabulary is not known; a row only needs
        # to be wide enough for the ids it allows (tokens past it are never allowed).
        width = max(self.vocab_size, max(forced, default=-1) + 1)
        words = (width + 31) // 32
        if (
            self._bitmask is None
            or self._bitmask.shape[0] < num_rows
            or self._bitmask.shape[1] != words
        ):
            self._bitmask = torch.empty((max(num_rows, 8), words), dtype=torch.int32)
        bitmask = self._bitmask
        row = 0
        for request in requests:
            if request.forced_token_ids:  # never speculated for
                _allow_only(bitmask[row], request.forced_token_ids[0])
                row += 1
                continue
            grammar = request.grammar
            draft = drafts.get(request.request_id, ()) if drafts else ()
            for token in draft:
                grammar.fill_bitmask(bitmask, row)
                row += 1
                grammar.accept_token(token)
            grammar.fill_bitmask(bitmask, row)
            row += 1
            if draft:
                grammar.rollback(len(draft))
        # A row that allows nothing: no token of this vocabulary continues the
        # constraint, whatever is sampled (the scheduler then fails it as a bad request).
        for row in torch.nonzero(~bitmask[:num_rows].any(dim=1)).flatten().tolist():
            owners[row].grammar_dead_end = True
        return GrammarOutput(
            req_ids=[r.request_id for r in owners],
            bitmask=bitmask[:num_rows].numpy().tobytes(),
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _allow_only(row: torch.Tensor, token_id: int) -> None:
    row.zero_()
    word, bit = divmod(token_id, 32)
    # Bit 31 is the int32 sign bit: the word is written as its signed value.
    row[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)


def model_vocab_size(config: StackConfig) -> int:
    """The width of the model's logits, from its config.json."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(resolve_model_path(config.model)).vocab_size)
