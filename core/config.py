"""StackConfig: stack.yaml plus overrides, validated before anything starts.

Every key is optional. Overrides name a key by its dotted path (`stack.scheduler`) or,
when unambiguous, by its leaf name (`scheduler`, `max_num_batched_tokens`), as the
offline `LLM(**overrides)` and the CLI flags do.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, model_validator

from plugserve.capabilities import reports_unavailability
from plugserve.plugins import SLOT_HOOKS, PluginError, get_registry

# The slots stack.yaml selects one name for; models are picked by the checkpoint's
# architecture, and model passes are a list (stack.model_passes).
# The speculative proposer is chosen inside `stack.speculative`, which may be unset.
STACK_SLOTS = tuple(
    slot for slot in SLOT_HOOKS if slot not in ("model", "model_pass", "spec_proposer")
)
# stack.linear_method left unset: each linear layer runs the first of these for bf16 on a
# CPU (the packed bf16 kernels), the second for fp32 on a CPU (oneDNN or F.linear, as
# timed), the third elsewhere (F.linear): worker/linear_methods.py.
AUTOMATIC_LINEAR_METHODS = ("cpu_bf16", "cpu_fp32", "plain")
# stack.model_passes left unset: these, in this order, those of them registered (the
# bundled ones only, so that an installed third-party pass never applies unasked; each
# pass declines what it cannot run: worker/model_passes.py).
AUTOMATIC_MODEL_PASSES = ("fused_cpu_decoder", "fused_cpu_encoder")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    # API-server processes sharing host:port and the engine cores (vLLM's
    # --api-server-count). 1: the API server runs in the launching process; N > 1: the
    # launching process supervises ApiServer_0 … ApiServer_{N-1}.
    api_server_count: int = Field(1, ge=1)
    # Browser origins allowed to call the API (CORS); empty: no CORS headers at all.
    # "*" allows any origin.
    allowed_origins: list[str] = Field(default_factory=list)
    # Sampling defaults from the model's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty) for requests that leave them out, as vLLM's
    # --generation-config auto; "none": the OpenAI defaults (temperature 1, top_p 1).
    generation_config: Literal["auto", "none"] = "auto"
    # One info line per finished request: id, prompt and output tokens, TTFT, total time,
    # finish reason.
    log_requests: bool = False
    # On SIGTERM (or SIGINT): requests in flight get this long to finish while new ones
    # are answered 503; then every process stops.
    shutdown_timeout: float = Field(30.0, ge=0)


class SpeculativeConfig(_Section):
    """Speculative decoding: `proposer` (register_spec_proposers) guesses up to
    `num_tokens` tokens per decoding request each step, and the target model verifies
    them in the same forward pass as the request's next token. The proposer's own
    settings (n-gram sizes, ...) go in its block under `plugins:`."""

    proposer: str
    num_tokens: int = Field(4, ge=1, le=32)


class StackSelection(_Section):
    """Which registered implementation fills each slot."""

    renderer: str = "hf"
    detokenizer: str = "incremental"
    tool_parser: str = "hermes"
    # Splits a reasoning model's output into its thinking and its answer
    # (register_reasoning_parsers): e.g. qwen3, deepseek_r1. None: no reasoning parsed.
    reasoning_parser: str | None = None
    transport: str = "zmq"
    scheduler: str = "fcfs"
    kv_allocator: str = "paged"
    structured_output: str = "xgrammar"
    executor: str = "uni"
    attention: str = "torch"
    # How every linear layer holds and multiplies its weight (register_linear_methods):
    # e.g. int8 (weight-only quantized). None: chosen by dtype and device
    # (AUTOMATIC_LINEAR_METHODS).
    linear_method: str | None = None
    # Rewrites of how the loaded model's layers run (register_model_passes), applied in
    # this order once the weights are processed: e.g. [fused_cpu_decoder]. None: the
    # bundled automatic ones (AUTOMATIC_MODEL_PASSES); []: none.
    model_passes: list[str] | None = None
    # Speculative decoding; None (the default): off, one token per request per pass.
    speculative: SpeculativeConfig | None = None
    # How a pooling model's prompt hidden states become one vector (register_poolers):
    # last, mean, cls, all. None: the checkpoint's sentence-transformers pooling config
    # (1_Pooling/config.json), else cls for encoders and classifiers, last for decoders.
    pooler: str | None = None

    @model_validator(mode="after")
    def _passes_once_each(self) -> StackSelection:
        passes = self.model_passes or []
        twice = sorted({name for name in passes if passes.count(name) > 1})
        if twice:
            raise ValueError(f"model_passes lists {', '.join(twice)} more than once")
        return self


class EngineConfig(_Section):
    max_num_seqs: int = Field(64, ge=1)
    # Requests allowed to wait for a running slot, per engine; past it the API server
    # answers 429 with Retry-After. None: no bound.
    max_waiting_requests: int | None = Field(None, ge=0)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(2048, ge=2)  # None: the model's own limit
    block_size: int = Field(16, ge=1)
    # KV pool size on CPU. On CUDA the pool is what gpu_memory_utilization leaves after
    # a profiling forward pass; num_kv_blocks, when set, overrides both.
    kv_cache_memory: ByteSize = ByteSize(1 << 30)
    num_kv_blocks: int | None = Field(None, ge=1)
    # CUDA only: the fraction of the device's memory the engine may fill (everything in
    # use on the device counts, weights and other processes included).
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # CUDA graphs for pure-decode steps; None: on when running on CUDA with an attention
    # backend that supports them, off otherwise.
    cuda_graphs: bool | None = None
    enable_prefix_caching: bool = True
    # Greedy output of a request the same, to the bit, whatever it is batched with: the
    # linear method and the attention backend keep each row's reductions in one order at
    # every batch size and chunking (capabilities.SupportsBatchInvariance); parts that
    # cannot are refused by name at start-up. Costs speed (docs/configuration.md).
    batch_invariant: bool = False
    tensor_parallel_size: int = Field(1, ge=1)
    # Pipeline stages (executor "mp" or "ray"): the decoder layers split into this many
    # consecutive runs, each stage `tensor_parallel_size` ranks; a stage holds the KV
    # cache of its own layers only, stage 0 the embeddings, the last stage the final
    # norm, the head and the sampler. Up to this many batches are in flight at once.
    pipeline_parallel_size: int = Field(1, ge=1)
    # Layers per stage, in order, summing to the model's layer count; None: as even as
    # possible, the first stages one longer (worker.parallel.stage_layer_ranges).
    pp_layer_partition: list[int] | None = None
    # Engine-core processes behind the one API server, each a full replica of the model.
    data_parallel_size: int = Field(1, ge=1)
    # Which of those engines this is: the server sets it in each engine's process. An
    # executor that places ranks on a cluster spreads the engines over its nodes by it.
    data_parallel_rank: int = Field(0, ge=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # What the engine serves: generate (sample tokens), pooling (embeddings, scores,
    # classes: the runner returns pooled outputs). auto: pooling for encoder and
    # classifier architectures and for checkpoints with sentence-transformers files
    # (modules.json), generate otherwise.
    runner: Literal["auto", "generate", "pooling"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    # Every this many seconds while busy, the engine logs its prompt and generation
    # throughput, running and waiting requests, KV cache usage and prefix-cache hit rate
    # (as vLLM); 0: never.
    log_stats_interval: float = Field(10.0, ge=0)
    num_threads: int | None = Field(None, ge=1)  # torch intra-op threads; None: all cores
    # Tensor parallelism over processes (executor "mp"): the workers join one
    # torch.distributed group through a TCP rendezvous that global rank 0 hosts at
    # master_addr:master_port. Across nodes, tensor_parallel_size counts every rank;
    # node k runs ranks k*local .. k*local+local-1 (local = tensor_parallel_size / nnodes);
    # node 0 runs the engine, the others run `python -m plugserve_plugins.executors.mp`.
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)  # None: pick a free port
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _budget_fits_a_sequence(self) -> EngineConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running request decodes a token "
                "per step"
            )
        return self

    @model_validator(mode="after")
    def _rank_among_engines(self) -> EngineConfig:
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank ({self.data_parallel_rank}) must be below "
                f"data_parallel_size ({self.data_parallel_size})"
            )
        return self

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> EngineConfig:
        if self.cuda_graphs and self.device == "cpu":
            raise ValueError("cuda_graphs: true needs CUDA, but device is 'cpu'")
        return self

    @model_validator(mode="after")
    def _nodes_fit(self) -> EngineConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                f"nnodes ({self.nnodes}): every node runs the same number of ranks"
            )
        if self.pp_layer_partition is not None and (
            len(self.pp_layer_partition) != self.pipeline_parallel_size
            or min(self.pp_layer_partition) < 1
        ):
            raise ValueError(
                f"pp_layer_partition ({self.pp_layer_partition}) must give "
                f"pipeline_parallel_size ({self.pipeline_parallel_size}) counts of at least "
                "one layer each"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError(
                "master_port must be set when nnodes > 1: every node dials the same rendezvous"
            )
        return self


class StackConfig(_Section):
    model: str = "smollm2-135m-instruct"
    server: ServerConfig = Field(default_factory=ServerConfig)
    stack: StackSelection = Field(default_factory=StackSelection)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # Per-plugin option blocks, keyed by the plugin's registered name; `disable` lists
    # entry points not to load.
    plugins: dict[str, Any] = Field(default_factory=dict)

    @property
    def disabled_plugins(self) -> list[str]:
        return list(self.plugins.get("disable", []))

    def plugin_options(self, name: str) -> dict[str, Any] | None:
        block = self.plugins.get(name)
        return dict(block) if block else None

    def check_plugins(self, slots: Iterable[str] | None = None) -> None:
        """Every selected name (of `slots`, default all) is registered and every option
        block validates against its plugin's `Options`; raises PluginError with what is
        available."""
        registry = get_registry(self.disabled_plugins)
        slots = tuple(slots or (*STACK_SLOTS, "model_pass", "spec_proposer"))
        for slot in (slot for slot in slots if slot in STACK_SLOTS):
            name = getattr(self.stack, slot)
            if name is not None:  # None: linear_method left to the dtype and device
                self._check_selected(slot, name, registry.get(slot, name))
        automatic = self._automatic_linear_methods()
        if "linear_method" in slots:
            available = registry.implementations("linear_method")
            for name in automatic:
                if name in self.plugins and name in available:
                    self._check_options(name, available[name].cls)
        passes = self._selected_model_passes()
        if "model_pass" in slots:
            available = registry.implementations("model_pass")
            for name in passes:
                if self.stack.model_passes is not None:  # named, not merely automatic
                    self._check_selected("model_pass", name, registry.get("model_pass", name))
                elif name in available:
                    self._check_options(name, available[name].cls)
        speculative = self.stack.speculative
        if speculative is not None and "spec_proposer" in slots:
            name = speculative.proposer
            self._check_selected("spec_proposer", name, registry.get("spec_proposer", name))
        selected = {getattr(self.stack, slot) for slot in STACK_SLOTS} - {None}
        selected |= set(automatic) | set(passes)
        if speculative is not None:
            selected.add(speculative.proposer)
        for name in self.plugins:
            if name != "disable" and name not in selected:
                raise PluginError(
                    f"plugins.{name}: options for a plugin the stack does not select; "
                    f"selected: {', '.join(sorted(selected))}"
                )

    def _check_selected(self, slot: str, name: str, cls: type) -> None:
        # A component that cannot run on this machine (no CUDA, a missing package) says
        # why, so the error comes now rather than from a dying engine.
        reason = cls.unavailable_reason() if reports_unavailability(cls) else None
        if reason:
            raise PluginError(f"{slot} {name!r} cannot run here: {reason}")
        self._check_options(name, cls)

    def _selected_model_passes(self) -> tuple[str, ...]:
        """The passes stack.model_passes names, or where unset the automatic ones (applied
        only where registered)."""
        passes = self.stack.model_passes
        return AUTOMATIC_MODEL_PASSES if passes is None else tuple(passes)

    def _automatic_linear_methods(self) -> tuple[str, ...]:
        """The linear methods the dtype and device may choose (none where one is named):
        options for them are theirs, whichever the engine then picks."""
        return AUTOMATIC_LINEAR_METHODS if self.stack.linear_method is None else ()

    def _check_options(self, name: str, cls: type) -> None:
        options_model = getattr(cls, "Options", None)
        if options_model is not None:
            try:
                options_model.model_validate(self.plugin_options(name) or {})
            except ValidationError as exc:
                raise PluginError(f"plugins.{name}: {_first_error(exc)}") from exc


def _leaf_paths() -> dict[str, list[str]]:
    """leaf name -> dotted paths it could mean."""
    paths: dict[str, list[str]] = {}
    for section, model in (
        ("server", ServerConfig),
        ("stack", StackSelection),
        ("engine", EngineConfig),
    ):
        for field in model.model_fields:
            paths.setdefault(field, []).append(f"{section}.{field}")
    paths.setdefault("model", []).append("model")
    return paths


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge overrides (dotted or leaf keys) into a raw config mapping."""
    leaves = _leaf_paths()
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in overrides.items():
        if "." in key:
            path = key
        elif key in leaves and len(leaves[key]) == 1:
            path = leaves[key][0]
        elif key in leaves:
            raise ValueError(f"override {key!r} is ambiguous: use one of {', '.join(leaves[key])}")
        else:
            known = ", ".join(sorted(leaves))
            raise ValueError(f"unknown setting {key!r}; known settings: {known}")
        *parents, leaf = path.split(".")
        node = merged
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[leaf] = value
    return merged


def load_config(
    path: str | Path | StackConfig | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    check_plugins: bool = True,
) -> StackConfig:
    """Read stack.yaml (or start from a StackConfig), apply overrides and validate
    everything, including the plugin names and their option blocks. Errors are
    ValueErrors with one clear line."""
    data: dict[str, Any] = {}
    if isinstance(path, StackConfig):
        data, path = path.model_dump(mode="json"), None
    elif path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path} must be a mapping of settings, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides or {})
    try:
        config = StackConfig.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        raise ValueError(f"{where}{_first_error(exc)}") from exc
    if check_plugins:
        config.check_plugins()
    return config


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more
