"""An executor plugin for the agreement check: the engine writes a given continuation.

`teacher_forced` is the in-process executor with one change in its model runner: at
every sampling step it records the full log-softmax of each row's logits, then lets the
row sample only the next token of that request's given continuation. The scheduler,
KV cache, chunked prefill, prefix caching, step inputs, attention backend and CUDA
graphs all run as in serving; only the choice of token is taken away, so every stack
sees the same token sequences and their per-position distributions can be compared.

It registers through the executor slot like any third party's plugin: the check puts
this module in PLUGSERVE_PLUGIN_MODULES and asks for `executor="teacher_forced"`.

`plant(...)` puts a known bug into the runner's step inputs, to show that the check
fails on one:
- "rope": a decoding token's position is one too far, so its query and key are rotated
  for the wrong place (its K/V still lands in the right slot);
- "page": every page index the attention reads is one too high (writes stay right).
"""

from __future__ import annotations

from typing import Any

import torch

from plugserve import hookimpl
from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, ModelRunnerOutput
from plugserve.interfaces.executor import KVCacheInfo
from plugserve.worker.model_runner import ModelRunner
from plugserve.worker.step_inputs import StepInputBuilder, StepInputs
from plugserve_plugins.executors.uni import UniProcExecutor

PLANTS = ("rope", "page")


class Forcing:
    """What the runner forces and what it saw, keyed by a request's prompt ids."""

    def __init__(self) -> None:
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        # prompt -> output index k -> log-softmax (float32, [vocab]) of the logits that
        # chose output token k, i.e. those at sequence position len(prompt) - 1 + k.
        self.seen: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        self.plant: str | None = None

    def reset(self, continuations: dict[tuple[int, ...], list[int]], plant: str | None) -> None:
        if plant is not None and plant not in PLANTS:
            raise ValueError(f"unknown planted bug {plant!r}; one of {PLANTS}")
        self.continuations = dict(continuations)
        self.seen = {}
        self.plant = plant


FORCING = Forcing()


class PlantedBugInputs:
    """StepInputBuilder with FORCING.plant's bug applied to what it builds."""

    def __init__(self, inner: StepInputBuilder, plant: str) -> None:
        self.inner = inner
        self.plant = plant

    def build(self, batch: Any, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        step = self.inner.build(batch, num_scheduled_tokens)
        att = step.attention
        if self.plant == "rope":
            starts = att.query_start_loc[:-1][step.query_lens == 1]
            step.positions[starts] += 1  # a view of this step's buffer, rebuilt next step
        elif self.plant == "page":
            step.attention = type(att)(
                query_start_loc=att.query_start_loc,
                seq_lens=att.seq_lens,
                block_table=att.block_table + 1,
                slot_mapping=att.slot_mapping,
            )
        return step


class TeacherForcedRunner(ModelRunner):
    def initialize(self) -> KVCacheInfo:
        info = super().initialize()
        if FORCING.plant is not None:
            self._step_inputs = PlantedBugInputs(self._step_inputs, FORCING.plant)  # type: ignore[assignment]
        return info

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        parked = self._parked
        if parked is not None and parked.logits is not None and parked.req_ids:
            batch = self.input_batch
            logprobs = parked.logits.float().log_softmax(dim=-1).cpu()
            forced = []
            for i, row in enumerate(parked.rows.tolist()):
                num_prompt = int(batch.num_prompt_tokens[row])
                prompt = tuple(batch.token_ids[row, :num_prompt].tolist())
                k = int(batch.num_tokens[row]) - num_prompt
                FORCING.seen.setdefault(prompt, {})[k] = logprobs[i]
                forced.append(FORCING.continuations[prompt][k])
            # Only the given token is left, so greedy sampling picks it.
            rows = torch.arange(len(forced), device=parked.logits.device)
            chosen = torch.tensor(forced, device=parked.logits.device)
            parked.logits.fill_(float("-inf"))
            parked.logits[rows, chosen] = 0.0
        return super().sample_tokens(grammar_output)


class TeacherForcedExecutor(UniProcExecutor):
    """The bundled in-process executor, running TeacherForcedRunner."""

    def __init__(self, *, config: StackConfig) -> None:
        if config.engine.tensor_parallel_size != 1:
            raise ValueError("executor 'teacher_forced' runs one rank")
        self.runner = TeacherForcedRunner(config)


@hookimpl
def register_executors(register: Any) -> None:
    register("teacher_forced", TeacherForcedExecutor)
