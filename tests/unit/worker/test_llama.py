"""Our LlamaForCausalLM + TorchPagedAttention against Hugging Face transformers.

The real SmolLM2 weights in fp32, prompts of different lengths run as one flat varlen
batch (with one prompt split into two chunks), then a decode step; plus tiny random
models covering what SmolLM2 does not use (biases, untied head, scaled RoPE, Qwen2).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from correctness.tiny_checkpoints import tiny
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from plugserve import ops
from plugserve.interfaces.model import AttentionBatch, AttentionSpec, CausalLM
from plugserve.model_files import load_tokenizer
from plugserve.worker import cpu_linear, cpu_ops
from plugserve.worker.kernel_plan import ROW_BUCKETS
from plugserve.worker.layers.decoder_layer import PreNormDecoderLayer
from plugserve.worker.layers.linear import Linear
from plugserve.worker.linear_methods import LinearMethodChooser, give_linear_methods
from plugserve.worker.model_loader import finish_loading, load_model
from plugserve.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from plugserve.worker.models.llama_cpu import FusedCpuDecoder, FusedCpuDecoderLayer
from plugserve.worker.parallel import ParallelContext
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

# fp32 end to end; what remains is summation order (fused QKV/gate-up matmuls, SDPA over
# paged keys). Observed on SmolLM2 ≈ 2e-5; logits span about ±30.
LOGITS_ATOL = 1e-3
BLOCK_SIZE = 16
# The fused CPU ops (cpu_ops.cpp), built wherever there is a C++ compiler, on any CPU.
OPS_MISSING = cpu_ops.unavailable_reason()
needs_fused_ops = pytest.mark.skipif(OPS_MISSING is not None, reason=f"cpu_ops.cpp: {OPS_MISSING}")


class PagedRunner:
    """Drives a model through the backend the way the model runner does: each request
    owns blocks from a shuffled pool; each step is one flat batch of (request, tokens)."""

    def __init__(self, model: Any, backend: TorchPagedAttention, num_blocks: int) -> None:
        self.model, self.backend = model, backend
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
        """rows: (request, new token ids) → fp32 logits of each row's last token."""
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for name, tokens in rows:
            start = self.num_computed.get(name, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            pos = np.arange(start, end)
            ids += tokens
            positions.append(pos)
            slots.append(np.asarray(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            seq_lens.append(end)
            tables.append(blocks)
            self.num_computed[name] = end
        table = np.zeros((len(rows), max(map(len, tables))), dtype=np.int32)
        for i, blocks in enumerate(tables):
            table[i, : len(blocks)] = blocks
        query_start = np.cumsum([0] + [len(tokens) for _, tokens in rows], dtype=np.int32)
        self.backend.prepare(
            AttentionBatch(
                query_start_loc=query_start,
                seq_lens=np.asarray(seq_lens, dtype=np.int32),
                block_table=table,
                slot_mapping=np.concatenate(slots).astype(np.int64),
            )
        )
        hidden = self.model(torch.tensor(ids), torch.from_numpy(np.concatenate(positions)))
        return self.model.compute_logits(hidden[torch.from_numpy(query_start[1:] - 1).long()])


def make_backend(
    config: Any, num_blocks: int, dtype: torch.dtype = torch.float32
) -> TorchPagedAttention:
    heads = config.num_attention_heads
    backend = TorchPagedAttention(
        spec=AttentionSpec(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            device=torch.device("cpu"),
        )
    )
    backend.allocate_kv_cache(num_blocks)
    return backend


def model_class(config: Any) -> type[LlamaForCausalLM]:
    """The class registered for the config's architecture."""
    return Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM


def bf16_model(
    config: Any, num_blocks: int, parallel: ParallelContext | None = None
) -> tuple[LlamaForCausalLM, TorchPagedAttention]:
    """A bf16 model (random weights) over its own bf16 backend, weights as built, its
    linears given the methods an engine gives them on this CPU (processed by
    finish_loading)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        backend = make_backend(config, num_blocks=num_blocks, dtype=torch.bfloat16)
        model = model_class(config)(hf_config=config, attention=backend, parallel=parallel)
        chooser = LinearMethodChooser(dtype=torch.bfloat16, device=torch.device("cpu"))
        give_linear_methods(model, chooser)
    finally:
        torch.set_default_dtype(previous)
    return model, backend


@torch.inference_mode()
def hf_last_logits(hf_model: Any, token_ids: list[int], count: int = 1) -> torch.Tensor:
    """Logits of the last `count` positions ([count, vocab]; [vocab] for one)."""
    logits = hf_model(torch.tensor([token_ids]), logits_to_keep=count).logits[0].float()
    return logits[0] if count == 1 else logits


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path, hf_reference_model) -> tuple[Any, Any, TorchPagedAttention]:
    tokenizer = load_tokenizer(smollm2_path)
    hf_model = hf_reference_model(torch.float32)  # from the GGUF, by transformers itself
    backend = make_backend(hf_model.config, num_blocks=64)
    started = time.perf_counter()
    model = load_model(smollm2_path, LlamaForCausalLM, backend, torch.float32, torch.device("cpu"))
    print(f"cached load_model: {time.perf_counter() - started:.2f} s")
    return model, hf_model, tokenizer


def test_is_a_causal_lm(smollm2: tuple[Any, Any, Any]) -> None:
    model, _, _ = smollm2
    assert isinstance(model, CausalLM)
    assert not model.training
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.compute_logits(torch.zeros(2, 576)).shape == (2, 49152)


def test_varlen_prefill_and_decode_match_transformers(smollm2: tuple[Any, Any, Any]) -> None:
    model, hf_model, tokenizer = smollm2
    chat = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = {
        "chat": tokenizer.encode(chat),
        "short": tokenizer.encode("The quick brown fox"),
        "long": tokenizer.encode(
            "Paged attention keeps the keys and values of every token in fixed-size blocks, "
            "so sequences of any length share one memory pool."
        ),
    }
    assert len({len(p) for p in prompts.values()}) == 3
    runner = PagedRunner(model, model.model.layers[0].self_attn.attention, num_blocks=64)
    split = len(prompts["long"]) // 2

    # Step 1: two whole prompts and the first chunk of the long one (its logits unused).
    step1 = runner.step(
        [("chat", prompts["chat"]), ("long", prompts["long"][:split]), ("short", prompts["short"])]
    )
    next_chat, next_short = int(step1[0].argmax()), int(step1[2].argmax())
    # Step 2: the long prompt's second chunk over cached context, and two decodes.
    step2 = runner.step(
        [("short", [next_short]), ("long", prompts["long"][split:]), ("chat", [next_chat])]
    )

    # Transformers runs each sequence alone; a prompt extended by its next token gives
    # both the prompt's last logits and the decode step's.
    chat_ref = hf_last_logits(hf_model, [*prompts["chat"], next_chat], count=2)
    short_ref = hf_last_logits(hf_model, [*prompts["short"], next_short], count=2)
    pairs = {
        "chat": (step1[0], chat_ref[0]),
        "short": (step1[2], short_ref[0]),
        "long": (step2[1], hf_last_logits(hf_model, prompts["long"])),
        "chat decode": (step2[2], chat_ref[1]),
        "short decode": (step2[0], short_ref[1]),
    }
    worst = 0.0
    for name, (ours, reference) in pairs.items():
        diff = (ours - reference).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGITS_ATOL, f"{name}: max |Δlogit| = {diff:.2e}"
        assert int(ours.argmax()) == int(reference.argmax()), name
    print(f"max |Δlogit| vs transformers: {worst:.2e}")


# --------------------------------------------------------------------------- tiny models

# tiny()'s layers with a vocabulary of 128 (these models need no tokenizer) and an MLP
# 96 wide; test_mistral, test_moe and test_phi3 build on the same sizes.
SIZES = tiny(vocab_size=128, intermediate_size=96, max_position_embeddings=256)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            LlamaConfig(
                **SIZES,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 50000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
            id="llama-bias-untied-llama3-rope",
        ),
        pytest.param(
            LlamaConfig(
                **SIZES,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            ),
            id="llama-tied-linear-rope",
        ),
        pytest.param(Qwen2Config(**SIZES, tie_word_embeddings=False), id="qwen2-qkv-bias"),
    ],
)
def test_tiny_random_models_match_transformers(config: Any) -> None:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = model_class(config)(hf_config=config, attention=make_backend(config, num_blocks=16))
    model.load_weights(hf_model.state_dict().items())
    runner = PagedRunner(model, model.model.layers[0].self_attn.attention, num_blocks=16)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (40, 3, 17)]
    ours = runner.step([(str(i), p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(ours[i], hf_last_logits(hf_model, prompt), atol=1e-4, rtol=0)


# A plan as measured on a 2-core Xeon with AMX: cpu_gemm for decode up to 8 rows, oneDNN's
# AMX tiles above, long prefill chunks' MLPs as oneDNN post-ops.
MIXED_PLAN = "own/tiled,own,onednn,onednn,onednn/fused-mlp"


@needs_fused_ops
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(LlamaConfig(**SIZES, tie_word_embeddings=True), id="llama-tied"),
        pytest.param(Qwen2Config(**SIZES, tie_word_embeddings=False), id="qwen2-qkv-bias"),
    ],
)
@pytest.mark.parametrize("kernel", ["own", "onednn", "mixed", "unpacked"])
def test_bf16_on_cpu_switches_to_the_fused_path_with_the_same_logits(
    config: Any, kernel: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """finish_loading moves a bf16 CPU model onto the fused ops and packed
    matmuls; it computes what the plain ATen path computes, within bf16 rounding. "own"
    takes the path of AVX512-BF16 CPUs without AMX (cpu_gemm.cpp, the stack as one
    FusedCpuDecoder), wherever this CPU can run it; "onednn" that of CPUs without
    AVX512-BF16; "mixed" a plan of both, by row count, prefill-sized MLPs as oneDNN
    post-ops; "unpacked" that of a CPU where neither kernel packs bf16, the layers then
    calling the Linear modules."""
    if kernel in ("own", "onednn"):
        request.getfixturevalue(f"{kernel}_kernel")  # conftest.py: forced, or skipped saying why
    if kernel == "mixed":
        request.getfixturevalue("own_kernel")
        request.getfixturevalue("onednn_kernel")
        monkeypatch.setenv(cpu_linear.KERNEL_ENV, MIXED_PLAN)
    if kernel == "unpacked":
        monkeypatch.setattr(cpu_linear, "packing_supported", lambda dtype, device: False)

    def build() -> LlamaForCausalLM:
        model, _ = bf16_model(config, num_blocks=16)
        model.load_weights(hf_model.state_dict().items())
        return model

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain, fast = build(), build()
    finish_loading(fast)

    assert fast.rotary.cos_sin is not None and plain.rotary.cos_sin is None
    assert fast.model.norm.fused and not plain.model.norm.fused
    # Every layer runs the one-frame-per-layer path, or, where every linear runs cpu_gemm,
    # the whole stack runs as FusedCpuDecoder (one op between two attention calls)...
    assert all(isinstance(f, FusedCpuDecoderLayer) for f in fast.layer_fns)
    own_kernel = kernel in ("own", "mixed")  # every weight has cpu_gemm's layout
    assert isinstance(fast.decoder, FusedCpuDecoder) == own_kernel
    assert plain.decoder is None
    assert all(isinstance(f, PreNormDecoderLayer) for f in plain.layer_fns)
    if kernel == "unpacked":  # ...through the Linear modules when nothing is packed
        assert all(m.packed is None for m in fast.modules() if isinstance(m, Linear))
        assert all(isinstance(f.qkv_proj, Linear) for f in fast.layer_fns)
    elif cpu_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        assert all(m.packed is not None for m in fast.modules() if isinstance(m, Linear))
        assert all(
            m.packed.own_kernel == own_kernel
            for m in fast.modules()
            if isinstance(m, Linear) and m.packed is not None
        )
        # The packed copies replace the loaded weights, which are freed...
        packed = [m for m in fast.modules() if isinstance(m, Linear) and m.packed is not None]
        assert packed and all(m.weight.numel() == 0 for m in packed)
        with pytest.raises(RuntimeError, match="packed"):
            fast.load_weights(hf_model.state_dict().items())
        if own_kernel:  # ...lying one after the other in one buffer,
            # in the order a step reads them, the LM head (a module or tied) last...
            weights = [m.packed.weight for m in packed]
            tied_head = fast.model.embed_tokens.packed_head
            if tied_head is not None:
                weights.append(tied_head.weight)
            starts = [w.data_ptr() for w in weights]
            ends = [w.data_ptr() + 2 * w.numel() for w in weights]
            assert starts[1:] == ends[:-1]
            assert starts[0] % ops.HUGE_PAGE_BYTES == 0
        # ...and on one rank the layers call the packed weights directly.
        assert all(isinstance(f.down_proj, cpu_linear.PackedLinear) for f in fast.layer_fns)
        assert fast.kernel_plan is not None
        assert all((f.fused_mlp is not None) == fast.kernel_plan.fused_mlp for f in fast.layer_fns)
        if kernel == "mixed":
            assert fast.kernel_plan.fused_mlp and not fast.decoder.runs(143)

    # 143 tokens: a prefill chunk's bucket, so oneDNN's prefill MLP runs where planned.
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (100, 3, 40)]
    rows = [(str(i), p) for i, p in enumerate(prompts)]
    expected = PagedRunner(plain, plain.model.layers[0].self_attn.attention, 16).step(rows)
    actual = PagedRunner(fast, fast.model.layers[0].self_attn.attention, 16).step(rows)
    # Random tiny models have logits of ~±1; bf16 steps there are 2^-8 relative.
    torch.testing.assert_close(actual, expected, atol=0.05, rtol=0.05)
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.99


@pytest.mark.usefixtures("own_kernel")
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(LlamaConfig(**SIZES, tie_word_embeddings=True), id="tied"),
        pytest.param(LlamaConfig(**SIZES, tie_word_embeddings=False), id="untied"),
    ],
)
@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_lm_head_gives_the_fp32_logits_unrounded(config: Any, rows: int) -> None:
    """The packed head writes the kernel's fp32 sums: logits not rounded to bf16 (which
    would be ~2^-9 off relative) and no conversion pass after it."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model, _ = bf16_model(config, num_blocks=16)
    model.load_weights(hf_model.state_dict().items())
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    weight = head.weight.detach().float().clone()  # packing frees an untied head's copy
    finish_loading(model)
    hidden = torch.randn(rows, config.hidden_size, dtype=torch.bfloat16)

    logits = model.compute_logits(hidden)

    assert logits is not None and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ weight.T, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
def test_the_layer_stack_in_one_op_computes_what_one_op_per_stretch_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the attention backend offers its kernel as a C++ call (cpu_layer_call), the
    whole stack runs as decode_layers; it makes the same calls in the same order as the
    per-stretch loop, so prefill and decode logits are equal bit for bit."""
    # cpu_gemm's vector kernel for every row count, as the stack runs it (a measured plan
    # may give some buckets AMX tiles, which run layer by layer).
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, ",".join(["own"] * len(ROW_BUCKETS)))
    config = LlamaConfig(**SIZES, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    def build() -> tuple[LlamaForCausalLM, TorchPagedAttention]:
        model, backend = bf16_model(config, num_blocks=16)
        model.load_weights(hf_model.state_dict().items())
        finish_loading(model)
        assert isinstance(model.decoder, FusedCpuDecoder)
        return model, backend

    (one_op, one_op_backend), (per_stretch, per_stretch_backend) = build(), build()
    one_op_calls: list[tuple[int, int] | None] = []
    offered = one_op_backend.cpu_layer_call
    monkeypatch.setattr(
        one_op_backend, "cpu_layer_call", lambda: one_op_calls.append(offered()) or offered()
    )
    # A backend without the C++ call: the decoder falls back to one op per stretch.
    monkeypatch.setattr(per_stretch_backend, "cpu_layer_call", lambda: None)

    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (20, 3, 40)]
    steps = [
        [(str(i), p) for i, p in enumerate(prompts)],  # prefill
        [(str(i), [7 + i]) for i in range(3)],  # decode, every row
        [("1", [9])],  # decode, one row
    ]
    a, b = (
        PagedRunner(one_op, one_op_backend, 16),
        PagedRunner(per_stretch, per_stretch_backend, 16),
    )
    for rows in steps:
        assert torch.equal(a.step(rows), b.step(rows))
    assert len(one_op_calls) == len(steps) and all(c is not None for c in one_op_calls)


@pytest.mark.usefixtures("own_kernel")
@needs_fused_ops
def test_the_layer_stack_op_rejects_a_missing_attention_call_and_an_unknown_layer() -> None:
    model, _ = bf16_model(LlamaConfig(**SIZES), num_blocks=4)
    finish_loading(model)
    decoder = model.decoder
    assert isinstance(decoder, FusedCpuDecoder)
    qkv = torch.zeros(1, (4 + 2 * 2) * 16, dtype=torch.bfloat16)
    residual = torch.zeros(1, 64, dtype=torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.long)
    decode_layers = torch.ops.plugserve_decoder.decode_layers
    with pytest.raises(RuntimeError, match="no attention call"):
        decode_layers(decoder.stack, qkv, residual, positions, 0, 0)
    # The two-layer stack against a backend whose cache holds one layer.
    one_layer = make_backend(
        LlamaConfig(**{**SIZES, "num_hidden_layers": 1}), num_blocks=4, dtype=torch.bfloat16
    )
    one_layer.prepare(
        AttentionBatch(
            query_start_loc=np.array([0, 1], dtype=np.int32),
            seq_lens=np.array([1], dtype=np.int32),
            block_table=np.zeros((1, 1), dtype=np.int32),
            slot_mapping=np.zeros(1, dtype=np.int64),
        )
    )
    call = one_layer.cpu_layer_call()
    assert call is not None
    with pytest.raises(RuntimeError, match="layer 1 is outside the cache"):
        decode_layers(decoder.stack, qkv, residual, positions, *call)


@pytest.mark.skipif(
    not cpu_linear.packing_supported(torch.bfloat16, torch.device("cpu"))
    or not cpu_ops.supported(torch.bfloat16, torch.device("cpu")),
    reason="no bf16 packing or fused ops on this CPU",
)
def test_a_tensor_parallel_shard_keeps_the_all_reduce_of_its_row_parallel_layers() -> None:
    """Rank 0 of 2, bf16 on CPU: the fused layers call the column-parallel projections'
    packed weights, but the row-parallel ones (o_proj, down_proj) through their modules,
    whose forward sums the partial products over ranks."""
    model, _ = bf16_model(
        LlamaConfig(**SIZES), num_blocks=1, parallel=ParallelContext(rank=0, world_size=2)
    )
    finish_loading(model)
    assert model.decoder is None  # its one op per stretch has no all-reduce
    for layer, fused in zip(model.model.layers, model.layer_fns, strict=True):
        assert isinstance(fused, FusedCpuDecoderLayer)
        assert fused.qkv_proj is layer.self_attn.qkv_proj.packed
        assert fused.gate_up_proj is layer.mlp.gate_up_proj.packed
        assert fused.o_proj is layer.self_attn.o_proj
        assert fused.down_proj is layer.mlp.down_proj


def test_load_weights_rejects_unknown_and_missing_tensors() -> None:
    config = LlamaConfig(**SIZES)
    model = LlamaForCausalLM(hf_config=config, attention=make_backend(config, num_blocks=1))
    weights = dict(AutoModelForCausalLM.from_config(config).state_dict())
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.q_norm.weight", None)])
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 weights.*gate_up_proj"):
        model.load_weights(weights.items())
