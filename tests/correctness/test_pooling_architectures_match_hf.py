"""Every pooling architecture on a tiny random checkpoint of its transformers family
equals transformers' own forward pass plus the pooling computed here by hand: BERT with
mean pooling (read from the checkpoint's sentence-transformers files), BERT and
XLM-RoBERTa cross-encoders (their classification heads, sigmoid for one label, softmax
for several; segment ids for BERT's pairs), XLM-RoBERTa embeddings (CLS), and Qwen2 /
Qwen3 causal checkpoints served as last-token embedders with chunked prefill and prefix
caching on, as are base-model checkpoints (transformers' Qwen2Model / Qwen3Model: no
`model.` prefix, no head), Qwen3-Embedding's layout included (those weights under a
config.json naming Qwen3ForCausalLM). Each holds batched and alone, and each of the six
transformers families also at tensor-parallel size 2 (one two-rank engine per case).

The reference is transformers loading the saved folder, one prompt at a time, in fp32,
computed once per case for the module.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from model_support import write_embedder_files

from plugserve import LLM
from plugserve.pooling_params import PoolingParams

VOCAB = 512
# Prompt lengths: a one-token prompt, short ones, and for decoders prompts longer than
# the chunk budget (so they prefill in chunks), two of them sharing a 32-token prefix.
LENGTHS = (1, 7, 13, 40)
DECODER_BUDGET = 16
ATOL = 2e-5  # fp32; summation order differs (fused q/k/v, SDPA over unpadded prompts)


def encoder_config(family: str, **extra: Any) -> Any:
    from transformers import BertConfig, XLMRobertaConfig

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )
    if family == "bert":
        return BertConfig(max_position_embeddings=64, type_vocab_size=2, **sizes)
    return XLMRobertaConfig(max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, **sizes)


def decoder_config(family: str) -> Any:
    from transformers import Qwen2Config, Qwen3Config

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return Qwen3Config(head_dim=16, **sizes) if family == "qwen3" else Qwen2Config(**sizes)


@dataclass(frozen=True)
class Case:
    name: str
    auto_class: str  # transformers' Auto class that builds the model
    config: Any
    pooling: str  # mean | cls | last | classify
    runner: str = "auto"
    pairs: bool = False  # cross-encoder prompts: (query, document) with segment ids
    # What config.json's architectures say, where not the saved class's name.
    config_architecture: str | None = None

    @property
    def is_decoder(self) -> bool:
        return self.pooling == "last"


CASES = [
    Case("bert-mean", "AutoModel", lambda: encoder_config("bert"), "mean"),
    Case(
        "bert-cross-encoder",
        "AutoModelForSequenceClassification",
        lambda: encoder_config("bert", num_labels=1),
        "classify",
        pairs=True,
    ),
    Case("xlm-roberta-cls", "AutoModel", lambda: encoder_config("xlm-roberta"), "cls"),
    Case(
        "xlm-roberta-classifier",
        "AutoModelForSequenceClassification",
        lambda: encoder_config("xlm-roberta", num_labels=3),
        "classify",
    ),
    Case(
        "qwen2-embedder", "AutoModelForCausalLM", lambda: decoder_config("qwen2"), "last", "pooling"
    ),
    Case(
        "qwen3-embedder", "AutoModelForCausalLM", lambda: decoder_config("qwen3"), "last", "pooling"
    ),
    Case("qwen2-base-model", "AutoModel", lambda: decoder_config("qwen2"), "last"),
    Case("qwen3-base-model", "AutoModel", lambda: decoder_config("qwen3"), "last"),
    Case(
        "qwen3-embedding-layout",
        "AutoModel",
        lambda: decoder_config("qwen3"),
        "last",
        "pooling",
        config_architecture="Qwen3ForCausalLM",
    ),
]
TP_CASES = (
    "bert-mean",
    "bert-cross-encoder",
    "xlm-roberta-cls",
    "xlm-roberta-classifier",
    "qwen2-embedder",
    "qwen3-embedder",
)


def prompts(case: Case) -> list[list[int]]:
    rng = np.random.default_rng(7)
    lengths = LENGTHS if case.is_decoder else LENGTHS[:3]
    out = [rng.integers(3, VOCAB, size=n).tolist() for n in lengths]
    if case.is_decoder:  # a second long prompt sharing the first one's 32-token prefix
        out.append(out[-1][:32] + rng.integers(3, VOCAB, size=5).tolist())
    return out


def segments(prompt: list[int]) -> list[int]:
    """A pair's segment ids: the first half is the query, the rest the document."""
    half = len(prompt) // 2
    return [0] * half + [1] * (len(prompt) - half)


def write_checkpoint(case: Case, folder: Path, smollm2_path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, case.auto_class).from_config(case.config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if ("norm" in name.lower() and name.endswith("weight")) else 0.0
            param.normal_(centre, 0.1)
    model.save_pretrained(str(folder))
    if case.config_architecture is not None:
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = [case.config_architecture]
        (folder / "config.json").write_text(json.dumps(config))
    if case.pooling == "mean":  # sentence-transformers' files name the pooling
        write_embedder_files(folder, smollm2_path, normalize=True)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(smollm2_path / name, folder / name)
    return folder


def reference(case: Case, folder: Path, prompt_list: list[list[int]]) -> list[np.ndarray]:
    import transformers

    auto = "AutoModel" if case.is_decoder else case.auto_class
    model = getattr(transformers, auto).from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompt_list:
            kwargs: dict[str, Any] = {"input_ids": torch.tensor([prompt])}
            if case.pairs:
                kwargs["token_type_ids"] = torch.tensor([segments(prompt)])
            result = model(**kwargs)
            if case.pooling == "classify":
                logits = result.logits[0]
                probs = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
                out.append(probs.numpy())
                continue
            hidden = result.last_hidden_state[0]
            pooled = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[case.pooling]
            out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return out


def served(
    case: Case, folder: Path, prompt_list: list[list[int]], alone: bool = True, **overrides: Any
):
    task = "classify" if case.pooling == "classify" else "embed"
    params = [
        PoolingParams(task=task, token_type_ids=segments(p) if case.pairs else None)
        for p in prompt_list
    ]
    settings = dict(dtype="float32", kv_cache_memory="8MiB", runner=case.runner, **overrides)
    if case.is_decoder:
        settings.update(max_num_batched_tokens=DECODER_BUDGET, max_num_seqs=8)
    llm = LLM(str(folder), **settings)
    inputs = [{"prompt_token_ids": p} for p in prompt_list]
    try:
        batched = llm.encode(inputs, params)
        one_by_one = (
            [llm.encode(i, p)[0] for i, p in zip(inputs, params, strict=True)] if alone else []
        )
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    return batched, one_by_one, stats


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_path):
    folders = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case.name)
        folders[case.name] = write_checkpoint(case, folder, smollm2_path)
    return folders


@pytest.fixture(scope="module")
def references(checkpoints):
    """Each case's expected outputs for its prompts, computed on first use."""
    cache: dict[str, list[np.ndarray]] = {}

    def expected(case: Case) -> list[np.ndarray]:
        if case.name not in cache:
            cache[case.name] = reference(case, checkpoints[case.name], prompts(case))
        return cache[case.name]

    return expected


def weight_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_transformers_batched_and_alone(case: Case, checkpoints, references) -> None:
    folder = checkpoints[case.name]
    prompt_list = prompts(case)
    expected = references(case)
    if case.is_decoder and case.auto_class == "AutoModel":  # saved as the base model
        names = weight_names(folder)
        assert "norm.weight" in names and not any(
            n.startswith(("model.", "lm_head.")) for n in names
        )
    batched, alone, stats = served(case, folder, prompt_list)
    for got in (batched, alone):
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            np.testing.assert_allclose(g, e, rtol=0, atol=ATOL, err_msg=f"prompt {i}")
    if case.is_decoder:  # the shared prefix and the repeated prompts hit the cache
        assert stats.prefix_cache_hits > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # every block back


@pytest.mark.parametrize("name", TP_CASES)
def test_matches_transformers_at_tensor_parallel_2(name: str, checkpoints, references) -> None:
    case = next(c for c in CASES if c.name == name)
    batched, _, _ = served(
        case,
        checkpoints[name],
        prompts(case),
        alone=False,
        tensor_parallel_size=2,
        executor="mp",
    )
    for i, (g, e) in enumerate(zip(batched, references(case), strict=True)):
        np.testing.assert_allclose(g, e, rtol=0, atol=ATOL, err_msg=f"prompt {i}")
