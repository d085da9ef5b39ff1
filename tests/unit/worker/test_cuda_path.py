"""The model runner's CUDA path: settings, the profiling batch, graph sizes and dispatch
(on CPU); KV sizing, pinned inputs and graph replay end to end (CUDA only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugserve.config import load_config
from plugserve.worker.cuda_graphs import (
    DecodeGraphs,
    capture_sizes,
    cuda_graphs_enabled,
    supports_cuda_graphs,
)
from plugserve.worker.cuda_path import dummy_prefill_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_settings_validate_with_one_line():
    engine = load_config(None, {}).engine
    assert engine.gpu_memory_utilization == 0.9 and engine.cuda_graphs is None
    for overrides, message in (
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"cuda_graphs": True, "device": "cpu"}, "cuda_graphs: true needs CUDA"),
    ):
        with pytest.raises(ValueError, match=message) as err:
            load_config(None, overrides)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("tokens", "rows", "block_size"), [(100, 8, 16), (2048, 64, 16), (5, 8, 4)]
)
def test_profiling_batch_is_a_full_step_of_fresh_prefills(tokens, rows, block_size):
    batch = dummy_prefill_batch(tokens, rows, block_size)
    lens = batch.query_lens
    assert batch.num_reqs == min(rows, tokens) and lens.sum() == tokens
    assert lens.max() - lens.min() <= 1
    assert np.array_equal(batch.seq_lens, lens)  # no context: every row is fresh
    slots = batch.slot_mapping
    assert len(np.unique(slots)) == tokens  # no two tokens share a slot
    num_blocks = int(batch.block_table[:, -1].max()) + 1  # what profile_kv_budget allocates
    assert slots.max() < num_blocks * block_size


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


class _GraphBackend:
    def init_cuda_graphs(self, sizes, max_blocks_per_req): ...

    def prepare_graph(self, batch, padded_size): ...


def test_graphs_setting_resolves_per_device_and_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not cuda_graphs_enabled(None, cpu, _GraphBackend(), attention_name="x", world_size=1)
    assert cuda_graphs_enabled(None, cuda, _GraphBackend(), attention_name="x", world_size=1)
    assert not cuda_graphs_enabled(False, cuda, _GraphBackend(), attention_name="x", world_size=1)
    assert not cuda_graphs_enabled(None, cuda, object(), attention_name="torch", world_size=1)
    assert not cuda_graphs_enabled(None, cuda, _GraphBackend(), attention_name="x", world_size=2)
    for device, backend, world, message in (
        (cpu, _GraphBackend(), 1, "runs on cpu"),
        (cuda, object(), 1, "attention 'torch' does not support them"),
        (cuda, _GraphBackend(), 2, "tensor parallelism"),
    ):
        with pytest.raises(ValueError, match=message):
            cuda_graphs_enabled(True, device, backend, attention_name="torch", world_size=world)


def test_the_torch_backend_has_no_graph_support_and_flashinfer_has():
    from plugserve_plugins.kernels.flashinfer import FlashInferAttention
    from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

    assert not supports_cuda_graphs(TorchPagedAttention)
    assert supports_cuda_graphs(FlashInferAttention)


def test_only_pure_decode_steps_that_fit_replay():
    graphs = DecodeGraphs(
        torch.nn.Identity(),
        _GraphBackend(),
        max_num_seqs=40,
        max_blocks_per_req=4,
        device=torch.device("cpu"),
    )
    assert graphs.padded_size(np.ones(3, dtype=np.int64)) is None  # nothing captured yet
    graphs._graphs = dict.fromkeys(graphs.sizes)  # as if captured
    assert graphs.padded_size(np.ones(3, dtype=np.int64)) == 4
    assert graphs.padded_size(np.ones(17, dtype=np.int64)) == 32
    assert graphs.padded_size(np.ones(40, dtype=np.int64)) == 40
    assert graphs.padded_size(np.array([1, 2, 1])) is None  # a prefill chunk: eager
    assert graphs.padded_size(np.ones(41, dtype=np.int64)) is None
    assert graphs.padded_size(np.ones(0, dtype=np.int64)) is None


# --------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from plugserve.worker.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("random") / "tiny", "tiny")


@needs_cuda
@pytest.mark.parametrize("attention", ["torch", "flashinfer"])
def test_generates_on_cuda(tiny, attention):
    from plugserve import LLM, SamplingParams
    from plugserve_plugins.kernels.flashinfer import FlashInferAttention

    if attention == "flashinfer" and (reason := FlashInferAttention.unavailable_reason()):
        pytest.skip(reason)
    llm = LLM(
        model=str(tiny),
        attention=attention,
        max_num_seqs=8,
        max_model_len=256,
        gpu_memory_utilization=0.5,
    )
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    assert (runner._graphs is not None) == (attention == "flashinfer")
    prompts = [{"prompt_token_ids": list(range(1, n + 1))} for n in (3, 40, 17, 100, 1)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 5
    # The KV pool is the useful maximum: 8 sequences of 256 tokens, plus one block.
    assert llm.engine.kv_cache_info.num_blocks == 8 * 256 // 16 + 1


@needs_cuda
def test_pinned_staging_round_trip():
    from plugserve.worker.cuda_path import PinnedStaging

    staging = PinnedStaging(16, 4)
    for step in range(3):
        arrays = (np.arange(10, dtype=np.int64) + step, np.arange(3, dtype=np.int64) * step)
        got = staging.to_device(arrays, torch.device("cuda"))
        assert [g.cpu().numpy().tolist() for g in got] == [a.tolist() for a in arrays]
