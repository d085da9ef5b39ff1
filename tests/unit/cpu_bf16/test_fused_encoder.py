"""The fused_cpu_encoder model pass against the modules it replaces: in bf16 on a CPU a
BERT encoder whose linears cpu_gemm.cpp packed runs each layer's stretch after attention as
one op (cpu_encoder.cpp), computing exactly what the modules compute (the same kernels in
the same order), batched and alone, GELU's erf and tanh forms alike; it declines, saying
why, what it cannot run (fp32, ReLU); the decoder pass does not look at encoders."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from plugserve import LLM
from plugserve.worker import cpu_ops
from plugserve_plugins.cpu_bf16 import cpu_features, kernel_setting
from plugserve_plugins.cpu_bf16.fused_encoder import FusedCpuEncoder
from tests.model_support import write_embedder_files

OPS_MISSING = cpu_ops.unavailable_reason()
ENCODER_MISSING = cpu_features.encoder_unavailable_reason()
needs_ops = pytest.mark.skipif(OPS_MISSING is not None, reason=f"cpu_ops.cpp: {OPS_MISSING}")
needs_encoder_op = pytest.mark.skipif(
    ENCODER_MISSING is not None, reason=f"cpu_encoder.cpp: {ENCODER_MISSING}"
)

VOCAB = 512
# One token, a few, one row-count bucket each (cpu_gemm's 2-8, 9-64, 65-256), and past it.
LENGTHS = (1, 5, 40, 100, 150)


def bert_folder(folder: Path, smollm2_path: Path, hidden_act: str) -> Path:
    """A tiny random BertModel with sentence-transformers' mean pooling files."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,  # head_dim 32: the varlen kernel's
        intermediate_size=256,
        max_position_embeddings=160,
        hidden_act=hidden_act,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = BertModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if ("LayerNorm" in name and name.endswith("weight")) else 0.0
            param.normal_(centre, 0.1)
    model.save_pretrained(str(folder))
    write_embedder_files(folder, smollm2_path, normalize=False)
    return folder


@pytest.fixture(scope="module", params=["gelu", "gelu_new"])
def gelu_bert(request: pytest.FixtureRequest, tmp_path_factory, smollm2_path: Path) -> Path:
    folder = tmp_path_factory.mktemp(f"bert-{request.param}")
    return bert_folder(folder, smollm2_path, request.param)


def prompts() -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(0, VOCAB, n).tolist()} for n in LENGTHS]


def embeddings(llm: LLM, alone: bool) -> list[np.ndarray]:
    if alone:
        return [llm.encode(prompt)[0] for prompt in prompts()]
    return llm.encode(prompts())


def engine(folder: Path, dtype: str = "bfloat16", **overrides: object) -> LLM:
    return LLM(str(folder), dtype=dtype, kv_cache_memory="8MiB", **overrides)


# Two engines compared bit for bit run the same attention: under `auto` each would time the
# varlen kernel against SDPA at its own start, and a busy machine could split them.
SAME_ATTENTION = {"plugins.torch.prefill_kernel": "on"}


# cpu_gemm.cpp forced wherever this CPU can run it (conftest.py), else skipped saying why.
@pytest.mark.usefixtures("own_kernel")
@needs_ops
@needs_encoder_op
@pytest.mark.parametrize("alone", [False, True], ids=["batched", "alone"])
def test_the_fused_encoder_computes_exactly_what_the_modules_compute(
    gelu_bert: Path, alone: bool
) -> None:
    fused = engine(gelu_bert, **SAME_ATTENTION)
    modules = engine(gelu_bert, model_passes=[], **SAME_ATTENTION)
    stack = fused.engine.executor.runner.model.whole_stack
    assert isinstance(stack, FusedCpuEncoder)
    # Every step of either way runs the stack (cpu_gemm at every row count here).
    assert all(stack.runs(rows) for rows in (*LENGTHS, sum(LENGTHS)))
    assert modules.engine.executor.runner.model.whole_stack is None
    for ours, theirs in zip(embeddings(fused, alone), embeddings(modules, alone), strict=True):
        assert np.array_equal(ours, theirs)


# cpu_gemm up to 8 rows, oneDNN above: longer prompts' steps run the modules, each linear
# through its plan's kernel.
MIXED_PLAN = "own,own,onednn,onednn,onednn"


@needs_ops
@needs_encoder_op
def test_steps_the_plan_gives_another_kernel_run_the_modules(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not cpu_features.onednn_bf16_supported():
        pytest.skip("oneDNN has no bf16 matmuls on this CPU")
    monkeypatch.setenv(kernel_setting.KERNEL_ENV, MIXED_PLAN)
    folder = bert_folder(tmp_path / "bert", smollm2_path, "gelu")
    fused = engine(folder, **SAME_ATTENTION)
    modules = engine(folder, model_passes=[], **SAME_ATTENTION)
    stack = fused.engine.executor.runner.model.whole_stack
    assert isinstance(stack, FusedCpuEncoder)
    assert [stack.runs(rows) for rows in LENGTHS] == [True, True, False, False, False]
    ours, theirs = embeddings(fused, alone=True), embeddings(modules, alone=True)
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.usefixtures("own_kernel")
@needs_ops
@needs_encoder_op
def test_the_start_up_log_says_the_encoder_runs_fused(
    tmp_path: Path, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = bert_folder(tmp_path / "bert", smollm2_path, "gelu")
    with caplog.at_level(logging.INFO, logger="plugserve.worker.model_passes"):
        engine(folder)
    assert (
        "layers 0-2: fused bf16 CPU encoder layer "
        "(one op per layer (cpu_encoder.cpp) at 1, 2-8, 9-64, 65-256, 257+ rows)"
    ) in caplog.text


@pytest.mark.parametrize(
    ("hidden_act", "dtype", "why"),
    [
        ("gelu", "float32", "the fused layers run bf16 on a CPU, the model float32 on cpu"),
        # Looked at once the encoder's op is known to run here.
        pytest.param("relu", "bfloat16", "its activation is not a GELU", marks=needs_encoder_op),
    ],
)
@needs_ops
def test_the_pass_declines_what_it_cannot_run_saying_why(
    tmp_path: Path,
    smollm2_path: Path,
    caplog: pytest.LogCaptureFixture,
    hidden_act: str,
    dtype: str,
    why: str,
) -> None:
    folder = bert_folder(tmp_path / "bert", smollm2_path, hidden_act)
    with caplog.at_level(logging.INFO, logger="plugserve.worker.model_passes"):
        llm = engine(folder, dtype=dtype)
    assert llm.engine.executor.runner.model.whole_stack is None
    assert (
        f"(model passes: fused_cpu_encoder):\n  layers 0-2: generic modules: fused_cpu_encoder: {why}"
        in caplog.text
    )
