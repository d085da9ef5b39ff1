"""The harness that proves an architecture against Hugging Face transformers on a tiny
checkpoint, with nothing downloaded.

A case is a transformers config of the family's own class (its structural options
switched on: biases, tied or untied head, scaled RoPE, q/k norm, ...) at a tiny size.
`write_tiny_checkpoint` builds the family's transformers model from it, draws every
parameter at random (biases and norm weights too, so a bias or norm loaded wrongly
shows; transformers would leave them 0 and 1) and saves it with `save_pretrained` in
small shards with their index, beside the embedded model's tokenizer files. The
reference is transformers loading that folder itself, never plugserve's loading.

`TinyRun.check` then holds plugserve's greedy continuation, served through `LLM` in fp32
with prefix caching and chunked prefill on, to the reference: the tokens equal, and the
logprob of every token within FP32_LOGPROB_TOLERANCE of transformers'. The same holds
at TP_SIZE ranks (the mp executor's worker processes) for every checkpoint whose shapes
the model's layers can shard (`tensor_parallel_refusal` asks them). Weights are drawn
with WEIGHT_STD so that logits spread (std ~0.8 at hidden size 64): the two best tokens
of a step are typically ~0.2 apart, four orders of magnitude above fp32 summation-order
noise, so equal tokens are the expected outcome and a mismatch reports transformers'
own margin at that step.

A new architecture's test needs only its config, in a module of its family under
architecture_cases/: `CASES = [TinyCase("qwen3", Qwen3Config(**tiny()))]`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from correctness.agreement import Reference
from plugserve import LLM, SamplingParams
from plugserve.worker.random_model import TOKENIZER_FILES

WEIGHT_STD = 0.1
NEW_TOKENS = 24
# fp32 end to end; what differs is summation order (fused q/k/v and gate/up matmuls,
# paged attention over chunks). Measured over the 18 cases of architecture_cases/ (Llama,
# Qwen2/3, Mistral, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE), batched and alone: largest
# difference 4.6e-4 nats (gemma3-qk-norm-two-ropes-tied; the Llama and Qwen2 cases
# 7.4e-5, where transformers' smallest margin between its two best tokens is 5.4e-4).
FP32_LOGPROB_TOLERANCE = 1e-3
# Tensor parallelism changes the order of the sums once more: each row-parallel
# projection (o_proj, down_proj, the experts') adds the ranks' partial products, and
# the vocab-parallel embedding is an all-reduce of each row and zeros. Measured at TP=2
# over the same 18 cases, batched: largest difference 4.6e-4 nats again, each case
# within 2e-6 of its single-process figure, so the single-process tolerance holds.
TP_SIZE = 2
FP32_TP_LOGPROB_TOLERANCE = FP32_LOGPROB_TOLERANCE
# Small enough that prompts of more than this many tokens are prefilled in chunks, and
# a mixed batch shares each step between decodes and a chunk.
CHUNK_TOKENS = 32
BLOCK_SIZE = 16


def tiny(**overrides: Any) -> dict[str, Any]:
    """The sizes every tiny case shares (2 layers, hidden 64, GQA 4:2, head_dim 16), with
    the embedded tokenizer's vocabulary and special ids; `overrides` replace any."""
    sizes: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    return {**sizes, **overrides}


@dataclass(frozen=True)
class TinyCase:
    """One architecture with one set of structural options."""

    id: str
    config: Any  # a transformers PretrainedConfig of the family's own class


def write_tiny_checkpoint(
    config: Any, folder: Path, tokenizer_folder: Path, *, seed: int = 0
) -> Path:
    """Save a random-weights model of `config` into `folder` as sharded safetensors with
    their index (as large checkpoints are published), plus the tokenizer files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # around 1, as trained norms are, but not exactly 1
                param.normal_(1.0, WEIGHT_STD)
            else:
                param.normal_(0.0, WEIGHT_STD)
    # 4 MB shards: the 12.6 MB embedding alone, the rest a shard or two.
    model.save_pretrained(str(folder), max_shard_size="4MB")
    assert (folder / "model.safetensors.index.json").is_file()
    for name in TOKENIZER_FILES:
        if name != "generation_config.json" and (tokenizer_folder / name).is_file():
            shutil.copyfile(tokenizer_folder / name, folder / name)
    return folder


def hf_references(
    folder: Path, prompts: Sequence[Sequence[int]], new_tokens: int = NEW_TOKENS
) -> list[Reference]:
    """transformers' greedy continuation of each prompt (one at a time, exactly
    `new_tokens` tokens) and the log-softmax of every step's logits, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([list(prompt)])
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.scores])
            references.append(Reference(tokens, logprobs))
    del model
    gc.collect()
    return references


def assert_matches(
    label: str,
    reference: Reference,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tolerance: float = FP32_LOGPROB_TOLERANCE,
) -> float:
    """Tokens equal to transformers', each token's logprob within `tolerance` of its;
    returns the largest logprob difference (what the tolerances are measured by)."""
    largest = 0.0
    for step, (theirs, mine) in enumerate(zip(reference.token_ids, token_ids, strict=True)):
        assert mine == theirs, (
            f"{label}, step {step}: token {mine}, transformers {theirs} "
            f"(its margin over the runner-up there: {reference.margin(step):.2e})"
        )
        expected = reference.logprobs[step, mine].item()
        difference = abs(logprobs[step] - expected)
        assert difference <= tolerance, (
            f"{label}, step {step}: logprob {logprobs[step]:.6f}, transformers {expected:.6f}"
        )
        largest = max(largest, difference)
    return largest


@dataclass
class TinyRun:
    """A tiny checkpoint on disk, its prompts and transformers' references for them."""

    model: str  # what LLM(model=...) is given: the folder, a Hub id, a GGUF path
    prompts: list[list[int]]
    references: list[Reference]

    @contextmanager
    def llm(self, **overrides: Any) -> Iterator[LLM]:
        """plugserve on this checkpoint in fp32, prefix caching on, prefill chunked at
        CHUNK_TOKENS; shut down (worker processes and all) and freed on exit, so each test
        holds one engine at a time."""
        settings: dict[str, Any] = {
            "dtype": "float32",
            "enable_prefix_caching": True,
            "max_num_batched_tokens": CHUNK_TOKENS,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": 8,
            "max_model_len": 512,
            "kv_cache_memory": "16MiB",
            **overrides,
        }
        llm = LLM(model=self.model, **settings)
        try:
            yield llm
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()

    @contextmanager
    def tensor_parallel_llm(self, **overrides: Any) -> Iterator[LLM]:
        """`llm` over TP_SIZE worker processes (the mp executor), one torch thread each:
        the ranks share the machine's cores and would only oversubscribe them."""
        with self.llm(
            executor="mp", tensor_parallel_size=TP_SIZE, num_threads=1, **overrides
        ) as llm:
            yield llm

    def check(self, llm: LLM, *, batched: bool, tolerance: float = FP32_LOGPROB_TOLERANCE) -> float:
        """Generate every prompt (in one call, or one call per prompt) and hold each
        continuation to its reference; returns the largest logprob difference."""
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        requests = [{"prompt_token_ids": p} for p in self.prompts]
        if batched:
            outputs = llm.generate(requests, params)
        else:
            outputs = [llm.generate([r], params)[0] for r in requests]
        largest = 0.0
        for prompt, reference, result in zip(self.prompts, self.references, outputs, strict=True):
            ours = result.outputs[0]
            assert ours.logprobs is not None
            chosen = [lp[t].logprob for t, lp in zip(ours.token_ids, ours.logprobs, strict=True)]
            label = f"{'batched' if batched else 'alone'}, {len(prompt)}-token prompt"
            difference = assert_matches(label, reference, ours.token_ids, chosen, tolerance)
            largest = max(largest, difference)
        return largest


def tensor_parallel_refusal(model: str, world_size: int = TP_SIZE) -> str | None:
    """Why the checkpoint at `model` cannot run over `world_size` tensor-parallel ranks,
    or None where it can. Asked of the model, not of a list of sizes: its registered
    class is built for every rank as an mp worker builds it (after load_model's own
    check that it takes `parallel=`), and its layers refuse the shapes they cannot shard
    (parallel.shard_heads, the MoE layer, ...) with a ValueError saying why. Building
    only computes the shards: nothing is loaded, no collective and no attention runs
    (hence no attention backend)."""
    from transformers import AutoConfig

    from plugserve.model_files import check_architecture
    from plugserve.plugins import get_registry
    from plugserve.worker.model_loader import accepts_parallel
    from plugserve.worker.parallel import ParallelContext

    registry = get_registry()
    model_cls = registry.get("model", check_architecture(model, registry.implementations("model")))
    if not accepts_parallel(model_cls):
        return f"{model_cls.__name__} takes no parallel= argument (no tensor parallelism)"
    hf_config = AutoConfig.from_pretrained(model)
    for rank in range(world_size):
        parallel = ParallelContext(rank=rank, world_size=world_size)
        try:
            model_cls(hf_config=hf_config, attention=None, parallel=parallel)
        except ValueError as error:
            return f"rank {rank} of {world_size}: {error}"
    gc.collect()
    return None


def put_in_hub_cache(folder: Path, cache_dir: Path, repo_id: str) -> Path:
    """Lay `folder`'s files out in a Hugging Face cache as `hf download repo_id` would:
    content-addressed blobs, a snapshot of symlinks to them under a commit hash, and
    refs/main naming that commit. Returns the snapshot folder."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# Hugging Face module names → llama.cpp's, for the Llama-family layouts (Qwen2/3 included).
_GGUF_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def write_gguf(folder: Path, gguf_path: Path, arch: str, tokenizer_gguf: Path) -> Path:
    """`folder`'s checkpoint as an fp32 GGUF of llama.cpp architecture `arch` (one whose
    q/k rows llama.cpp keeps in Hugging Face's order, as for qwen2 and qwen3), with the
    tokenizer metadata of `tokenizer_gguf` (the embedded model's), as llama.cpp's
    convert_hf_to_gguf.py would write it."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    source = gguf.GGUFReader(str(tokenizer_gguf))
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    for name, tensor in weights.items():
        stem, _, suffix = name.rpartition(".")
        if stem in _GGUF_GLOBAL_TENSORS:
            gguf_name = f"{_GGUF_GLOBAL_TENSORS[stem]}.{suffix}"
        else:
            _, _, index, module = stem.split(".", 3)  # model.layers.N.<module>
            gguf_name = f"blk.{index}.{_GGUF_LAYER_TENSORS[module]}.{suffix}"
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def tokenizer_folder(smollm2_path: Path, dest: Path) -> Path:
    """The embedded model's tokenizer files (what every tiny checkpoint is paired with)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copyfile(smollm2_path / name, dest / name)
    meta = json.loads((smollm2_path / "config.json").read_text())
    assert meta["vocab_size"] == tiny()["vocab_size"]
    return dest
