"""ModelRunner: turns one SchedulerOutput into one forward pass, then into tokens.

`execute_model` (phase 7) applies the step's changes to the persistent batch, builds
the flat varlen inputs with numpy into reused buffers (step_inputs.py), runs the model
over every scheduled token, keeps the logits of the rows that sample this step and
parks them. `sample_tokens` (phase 8)
samples from the parked logits. A row verifying draft tokens (speculative decoding,
spec_decode.py) computes logits at each of them and goes through the rejection sampler.

Under tensor parallelism every rank runs this same runner on the same SchedulerOutput,
so the persistent batches stay identical: rank 0 gathers the logits, samples, and
broadcasts the sampled ids so that every rank appends the same tokens.

Under pipeline parallelism (a StagePlacement, worker/parallel.py) the runner holds one
stage: its layers and their KV cache only. A stage other than the first receives its
activations from the previous one, a stage other than the last sends its own on and
samples nothing (`samples` is False); the tokens the last stage sampled reach its
persistent batch through `append_tokens`.

On CUDA: the KV pool is sized from `engine.gpu_memory_utilization` after a profiling
forward pass, step inputs go through pinned host buffers with non-blocking copies, and
pure-decode steps replay CUDA graphs (cuda_graphs.py) when the attention backend
supports them. On CPU none of that runs.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from plugserve.capabilities import (
    describes_linears,
    supports_weight_buffer,
)
from plugserve.config import StackConfig
from plugserve.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from plugserve.device import choose_dtype, dtype_name, resolve_device
from plugserve.interfaces.executor import KVCacheInfo
from plugserve.interfaces.model import AttentionSpec
from plugserve.model_files import check_architecture, resolve_model_path
from plugserve.ops.process_env import release_free_heap
from plugserve.plugins import get_registry
from plugserve.pooling_setup import pooling_setup
from plugserve.worker.batch_invariance import (
    make_attention_batch_invariant,
    refuse_batch_dependent_layers,
)
from plugserve.worker.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
from plugserve.worker.cuda_path import PinnedStaging
from plugserve.worker.input_batch import InputBatch
from plugserve.worker.kv_cache_size import num_kv_blocks
from plugserve.worker.layer_attention import (
    attention_layers,
    check_layer_attention,
    context_limit,
)
from plugserve.worker.linear_methods import LinearMethodChooser, linear_methods_of
from plugserve.worker.model_loader import load_model
from plugserve.worker.model_passes import model_passes_from_config
from plugserve.worker.models.decoder import StageActivations
from plugserve.worker.parallel import (
    NO_PARALLEL,
    ParallelContext,
    PipelineLink,
    PipelineStage,
    StagePlacement,
)
from plugserve.worker.parked_logits import ParkedLogits
from plugserve.worker.pooled_outputs import PooledOutputs
from plugserve.worker.prompt_logprobs import prompt_logprobs_of_step
from plugserve.worker.proposer_model import WorkerProposal, load_worker_proposal
from plugserve.worker.sampler import Sampler, SamplingMetadata
from plugserve.worker.spec_decode import verify_drafts, write_drafts
from plugserve.worker.step_inputs import StepInputBuilder

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: StackConfig,
        parallel: ParallelContext | None = None,
        placement: StagePlacement | None = None,
    ) -> None:
        self.config = config
        self.parallel = parallel or NO_PARALLEL
        self.placement = placement
        # Set by initialize under pipeline parallelism.
        self.stage: PipelineStage | None = None
        self._link: PipelineLink | None = None
        # Under pipeline parallelism: this rank's seconds in execute_model and
        # sample_tokens so far, and the stages' figures the last activations carried.
        self.busy_seconds = 0.0
        self._stage_busy: list[float] = []
        self._sampling_started = 0.0
        engine = config.engine
        self.device = resolve_device(engine.device)
        self.dtype, self._dtype_reason = choose_dtype(engine.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(engine.num_threads or os.cpu_count() or 1)
        self.block_size = engine.block_size
        self.sampler = Sampler()
        self._parked: ParkedLogits | None = None
        # The last step's sampling metadata and what it was built for (batch version,
        # rows): reused while neither changes, as at every decode step of a steady batch.
        self._metadata: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        self._staging = (
            # input ids, positions (one per token), logits indices (one per row)
            PinnedStaging(
                engine.max_num_batched_tokens, engine.max_num_batched_tokens, engine.max_num_seqs
            )
            if self.device.type == "cuda"
            else None
        )
        self._graphs: DecodeGraphs | None = None
        # A pooling model's outputs (engine.runner): execute_model returns them itself.
        self.pooling: PooledOutputs | None = None
        # A speculative proposer that runs here, with its own model (proposer_model.py).
        self.proposal: WorkerProposal | None = None

    # ------------------------------------------------------------------ start-up

    def initialize(self) -> KVCacheInfo:
        registry = get_registry(self.config.disabled_plugins)
        model_path = resolve_model_path(self.config.model)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        model_cls = registry.get(
            "model", check_architecture(model_path, registry.implementations("model"))
        )

        setup = pooling_setup(model_path, self.config.engine.runner, self.config.stack.pooler)
        if setup.is_pooling and self.placement is not None:
            raise ValueError("a pooling model runs whole in each rank: no pipeline parallelism")
        model_max = context_limit(model_cls, hf_config, setup)
        self.max_model_len = min(self.config.engine.max_model_len or model_max, model_max)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        # This rank's heads: its attention backend and KV cache hold only those.
        heads = self.parallel.head_shard(
            num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads
        )
        layers = range(hf_config.num_hidden_layers)
        if self.placement is not None:
            self.stage = self.placement.stage(hf_config.num_hidden_layers)
            layers = range(self.stage.first_layer, self.stage.end_layer or len(layers))
            self._link = PipelineLink(
                self.placement, hf_config.hidden_size, self.dtype, self.device
            )
        # This stage's layers only: its KV cache holds theirs.
        layer_attention = attention_layers(model_cls, hf_config)
        spec = AttentionSpec(
            num_layers=len(layers),
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            layers=layer_attention[layers.start : layers.stop] if layer_attention else (),
        )
        name = self.config.stack.attention
        check_layer_attention(registry.get("attention", name), name, spec.layers)
        self.attention = registry.build(
            "attention", name, self.config.plugin_options(name), spec=spec
        )
        if self.config.engine.batch_invariant:
            make_attention_batch_invariant(self.attention, name)
        start = time.perf_counter()
        parallel = self.parallel if self.parallel.world_size > 1 else None
        linear_methods = LinearMethodChooser.from_config(
            self.config, self.dtype, self.device, registry
        )
        self.model = load_model(
            model_path,
            model_cls,
            self.attention,
            self.dtype,
            self.device,
            parallel,
            linear_methods=linear_methods,
            model_passes=model_passes_from_config(self.config, registry),
            stage=self.stage,
            lm_head=not setup.is_pooling,
        )
        if self.config.engine.batch_invariant:
            refuse_batch_dependent_layers(self.model)
        logger.info("model loaded in %.1f s", time.perf_counter() - start)
        if setup.is_pooling:
            self.pooling = PooledOutputs.build(self.model, setup, self.config, registry)
        logger.info("%s", self._describe_kernels())
        self.proposal = load_worker_proposal(
            self.config,
            registry,
            target_vocab_size=hf_config.vocab_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            parallel=self.parallel,
            block_size=self.block_size,
            is_pooling=setup.is_pooling,
            is_pipeline_stage=self.placement is not None,
        )

        # Ranks hold different numbers of KV heads (uneven shards), and stages different
        # numbers of layers, hence fit different numbers of blocks; block ids are shared,
        # so all use the smallest count.
        agreeing = self.parallel if self.placement is None else self.placement.world
        num_blocks = agreeing.min_int(
            num_kv_blocks(
                self.config.engine,
                self.attention,
                self.model,
                self.device,
                self.max_model_len,
                setup,
                extra_bytes_per_block=self.proposal.kv_cache_bytes_per_block()
                if self.proposal
                else 0,
            )
        )
        self.attention.allocate_kv_cache(num_blocks)
        if self.proposal is not None:
            self.proposal.allocate_kv_cache(num_blocks)
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        # Decode graphs capture the whole model's forward; a stage's is split by sends.
        if (
            self.pooling is None
            and self.stage is None
            and cuda_graphs_enabled(
                self.config.engine.cuda_graphs,
                self.device,
                self.attention,
                attention_name=name,
                world_size=self.parallel.world_size,
            )
        ):
            self._graphs = DecodeGraphs(
                self.model,
                self.attention,
                max_num_seqs=self.config.engine.max_num_seqs,
                max_blocks_per_req=max_blocks_per_req,
                device=self.device,
            )
            self._graphs.capture()
        self.input_batch = InputBatch(
            max_num_reqs=self.config.engine.max_num_seqs,
            max_model_len=self.max_model_len,
            max_blocks_per_req=max_blocks_per_req,
            device=self.device,
        )
        if self.proposal is not None:
            self.proposal.bind(self.input_batch)
        self._step_inputs = StepInputBuilder(
            self.config.engine.max_num_batched_tokens,
            self.config.engine.max_num_seqs,
            self.block_size,
        )
        self.vocab_size = hf_config.vocab_size
        release_free_heap()
        return KVCacheInfo(
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
        )

    def _describe_kernels(self) -> str:
        """The start-up line: the dtype and why, and how the linears and attention run."""
        line = f"dtype {dtype_name(self.dtype)} ({self._dtype_reason})"
        for method in linear_methods_of(self.model):
            if describes_linears(method):
                line += f"; {method.describe()}"
        return f"{line}; attention: {self.config.stack.attention}"

    def measure_weight_read(self, seconds: float) -> tuple[int, float]:
        """(weight bytes, bytes/s): how fast this process reads the buffer of weights its
        batch-1 steps read, now. ValueError where the model keeps no such buffer."""
        data = self.model.weight_buffer() if supports_weight_buffer(self.model) else None
        if data is None:
            raise ValueError(
                "the model keeps no single weight buffer to read (only bfloat16 on a CPU "
                "with AVX512-BF16 packs its weights in one)"
            )
        from plugserve.bench.roofline import read_bandwidth

        return data.numel() * data.element_size(), read_bandwidth(data, seconds)

    # ------------------------------------------------------------------ phase 7

    @property
    def samples(self) -> bool:
        """Whether this runner computes logits and samples: the last pipeline stage."""
        return self.stage is None or self.stage.is_last

    def append_tokens(self, sampled: dict[str, list[int]]) -> None:
        """Tokens another stage sampled, appended to their requests' rows (requests no
        longer in the batch are skipped: they finished or were preempted meanwhile)."""
        batch = self.input_batch
        for req_id, tokens in sampled.items():
            row = batch.req_id_to_row.get(req_id)
            for token in tokens if row is not None else ():
                batch.append_sampled(np.array([row]), np.array([token]))

    def _update_batch(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        if so.finished_req_ids or so.preempted_req_ids:
            batch.remove_requests(so.finished_req_ids | so.preempted_req_ids, so.finished_req_ids)
            if self.pooling is not None:
                self.pooling.forget(so.finished_req_ids | so.preempted_req_ids)
        if self.pooling is not None:
            self.pooling.add(so.scheduled_new_reqs)
        cached = so.scheduled_cached_reqs
        for i, (req_id, new_blocks, num_computed) in enumerate(
            zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)
        ):
            row = batch.req_id_to_row[req_id]
            if cached.num_kept_blocks:
                batch.num_blocks[row] = cached.num_kept_blocks[i]
            batch.append_blocks(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed
        for new in so.scheduled_new_reqs:
            batch.add_request(new)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_batch(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch
        num_drafts = write_drafts(batch, so.scheduled_spec_decode_tokens)
        step = self._step_inputs.build(batch, so.num_scheduled_tokens, num_drafts)
        attn_batch = step.attention
        ids_t, positions_t, logits_indices = self._inputs_to_device(
            step.input_ids, step.positions, step.logits_indices
        )
        graph_size = self._graphs.padded_size(step.query_lens) if self._graphs else None
        if graph_size is not None:
            assert self._graphs is not None
            hidden = self._graphs.run(attn_batch, graph_size, ids_t, positions_t)
        else:
            self.attention.prepare(attn_batch)
            if self.pooling is not None:
                hidden = self.pooling.forward(self.input_batch, so, ids_t, positions_t)
            elif self.stage is None:
                hidden = self.model(ids_t, positions_t)
            else:
                stage_output = self._run_stage(ids_t, positions_t)
                if stage_output is None:
                    return None  # sent on to the next stage, which samples
                hidden = stage_output
        if self.pooling is not None:  # nothing to sample: the pooled outputs, now
            pooled = self.pooling.pool(batch, so, attn_batch.query_start_loc, hidden)
            return ModelRunnerOutput(sampled_token_ids={}, pooled=pooled)
        if self.proposal is not None:
            self.proposal.catch_up(attn_batch, ids_t, positions_t)
        prompt_logprobs = (
            prompt_logprobs_of_step(
                so, self.input_batch, step.attention.query_start_loc, hidden, self.model
            )
            if np.any(batch.num_prompt_logprobs[: batch.num_reqs] >= 0)
            else None
        )
        sample_rows = step.sample_rows
        # Skipped (on every rank alike) when no row samples: a collective over empty
        # tensors is pointless and not every backend accepts one.
        if len(logits_indices) < hidden.shape[0]:
            hidden = hidden[logits_indices]
        # (Else every token is its row's last, in order: as at a decode step, all of them.)
        logits = self.model.compute_logits(hidden) if len(sample_rows) else None
        req_ids = [batch.req_ids[r] for r in sample_rows]
        self._parked = ParkedLogits(
            logits=logits,
            rows=sample_rows,
            req_ids=req_ids,
            prompt_logprobs=prompt_logprobs,
            drafts=[so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
            if num_drafts is not None
            else None,
        )
        return None

    def _run_stage(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """This pipeline stage's layers: the final hidden states on the last stage; on the
        others the activations go to the next stage and None is returned."""
        assert self.stage is not None and self._link is not None
        previous = None
        if self.stage.is_first:
            self._stage_busy = [0.0] * self.stage.count
        else:
            hidden, residual, self._stage_busy = self._link.receive(ids.shape[0])
            previous = StageActivations(hidden, residual)
        started = time.perf_counter()
        output = self.model.forward_stage(ids, positions, previous)
        self.busy_seconds += time.perf_counter() - started
        if isinstance(output, StageActivations):
            self._stage_busy[self.stage.index] = self.busy_seconds
            self._link.send(output.hidden, output.residual, self._stage_busy)
            return None
        return output

    def _inputs_to_device(
        self, input_ids: np.ndarray, positions: np.ndarray, logits_indices: np.ndarray
    ) -> list[torch.Tensor]:
        if self._staging is not None:
            return self._staging.to_device((input_ids, positions, logits_indices), self.device)
        # CPU: the tensors share the arrays' memory, no copy at all.
        return [torch.from_numpy(a) for a in (input_ids, positions, logits_indices)]

    # ------------------------------------------------------------------ phase 8

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        self._sampling_started = time.perf_counter()
        parked, self._parked = self._parked, None
        if parked is None or not parked.req_ids:
            return ModelRunnerOutput(
                sampled_token_ids={},
                prompt_logprobs=(parked.prompt_logprobs if parked is not None else None) or {},
            )
        if parked.drafts is not None:
            return self._verify_drafts(parked, grammar_output)
        out = None
        if parked.logits is not None:  # the driver rank (or no tensor parallelism)
            if grammar_output is not None and grammar_output.req_ids:
                parked.apply_grammar(grammar_output)
            metadata = self._sampling_metadata(parked.rows)
            out = self.sampler(parked.logits, metadata)
            sampled_tensor = out.sampled_token_ids.to(torch.int64)
        else:
            sampled_tensor = torch.empty(len(parked.rows), dtype=torch.int64, device=self.device)
        if self.parallel.world_size > 1:
            # Every rank's persistent batch must hold the tokens rank 0 sampled.
            self.parallel.broadcast(sampled_tensor)
        sampled = sampled_tensor.cpu().numpy()
        self.input_batch.append_sampled(parked.rows, sampled)
        sampled_list = sampled.tolist()
        result = ModelRunnerOutput(
            sampled_token_ids={
                rid: [tok] for rid, tok in zip(parked.req_ids, sampled_list, strict=True)
            }
        )
        if out is not None and out.logprobs is not None:
            result.logprobs = parked.logprobs_lists(self.input_batch.num_logprobs, out.logprobs)
        if parked.prompt_logprobs:
            result.prompt_logprobs = parked.prompt_logprobs
        if self.proposal is not None:
            result.draft_token_ids = self.proposal.propose(parked.rows, parked.req_ids)
        if self.stage is not None:
            self.busy_seconds += time.perf_counter() - self._sampling_started
            self._stage_busy[self.stage.index] = self.busy_seconds
            result.stage_busy_seconds = list(self._stage_busy)
        return result

    def _verify_drafts(
        self, parked: ParkedLogits, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput:
        """sample_tokens for a step where some rows verify draft tokens."""
        assert parked.drafts is not None
        counts = np.array([len(d) + 1 for d in parked.drafts], dtype=np.int64)
        if parked.logits is not None and grammar_output is not None and grammar_output.req_ids:
            parked.apply_grammar(grammar_output, counts)
        result = verify_drafts(
            self.input_batch,
            parked.logits,
            parked.rows,
            parked.req_ids,
            parked.drafts,
            vocab_size=self.vocab_size,
            parallel=self.parallel,
        )
        if parked.prompt_logprobs:
            result.prompt_logprobs = parked.prompt_logprobs
        if self.proposal is not None:
            result.draft_token_ids = self.proposal.propose(parked.rows, parked.req_ids)
        if self.stage is not None:
            self.busy_seconds += time.perf_counter() - self._sampling_started
            self._stage_busy[self.stage.index] = self.busy_seconds
            result.stage_busy_seconds = list(self._stage_busy)
        return result

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        key = (self.input_batch.version, rows.tobytes())
        if self._metadata is not None and self._metadata[0] == key:
            return self._metadata[1]
        metadata = self.input_batch.sampling_metadata(rows, self.vocab_size)
        # Penalties and bad words read the tokens so far, which change every step: never
        # reused.
        self._metadata = None if metadata.reads_output else (key, metadata)
        return metadata
