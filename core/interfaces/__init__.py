"""The contract of every swappable part: one typing.Protocol per slot.

A plugin registers a class for a slot (see hookspecs.py); the core builds it with the
keyword arguments documented on the Protocol's `__init__` plus, when the class declares
an `Options` pydantic model, `options=` validated from its block under `plugins:` in
stack.yaml. The hot path calls these objects directly, never through pluggy.

What a part may offer beyond its slot's Protocol is a capability, declared in
plugserve.capabilities with a `supports_x(obj)` check. RankedPolicy, beside the
SchedulingPolicy Protocol, is a base class: a scheduling policy written on it is only its
rank function. ApiServer and EngineClient are no slot's: they are what the
`register_routes` hook hands a plugin that adds endpoints.

The types these Protocols speak in (Request, SchedulerOutput, ModelRunnerOutput,
RequestDelta) live in plugserve.datatypes; these modules import no engine, worker or
frontend module. Each name has one home, its module here:

- frontend: Renderer, Detokenizer, ToolParser (with ToolCall, ExtractedToolCalls), and the
  EngineClient and ApiServer an endpoint plugin is handed
- transport: Transport, its ClientChannel and EngineChannel, Frames
- scheduling: SchedulingPolicy, RankedPolicy
- kv_cache: KVAllocator, KVCacheStats
- executor: Executor, KVCacheInfo
- structured_output: StructuredOutputBackend, Grammar
- speculative: SpecProposer (with DraftRequest), and for a proposer that runs in the
  worker (capabilities.ProposesInWorker) ProposerModel and WorkerDraftRequests
- model: AttentionBackend (with LayerAttention, FULL_ATTENTION, AttentionSpec,
  AttentionBatch), LinearMethod (with LinearLayer, LinearCompute, TiedLmHead), CausalLM,
  ModelPass (with DecoderFrame, WholeStack, EncoderFrame, WholeEncoderStack, LayerRoute)
- pooling: Pooler (with PoolerTokens)
"""
