"""The flashinfer attention backend.

Everywhere: the module imports without CUDA or FlashInfer, says why it cannot run, and
selecting it fails with one line at config time (CLI, offline API) and, should the
config check be skipped, when the engine builds it. The host-side page table is checked
against a per-row walk. On a CUDA machine with FlashInfer: numerics against the torch
backend on a mixed batch, and the padded CUDA-graph path against the eager one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from plugserve.cli import main
from plugserve.config import load_config
from plugserve.interfaces.model import FULL_ATTENTION, AttentionBatch, AttentionSpec, LayerAttention
from plugserve.plugins import PluginError, get_registry
from plugserve_plugins.kernels import flashinfer as fi_module
from plugserve_plugins.kernels.flashinfer import (
    FlashInferAttention,
    pad_decode_rows,
    paged_metadata,
    plan_options,
)

REASON = FlashInferAttention.unavailable_reason()
needs_flashinfer = pytest.mark.skipif(REASON is not None, reason=f"flashinfer: {REASON}")


@pytest.fixture
def unavailable(monkeypatch):
    """Force the backend to report itself unavailable, whatever this machine has."""
    reason = "needs CUDA (torch.cuda.is_available() is False)"
    monkeypatch.setattr(FlashInferAttention, "unavailable_reason", classmethod(lambda _: reason))
    return reason


def test_registered_and_importable_everywhere():
    assert get_registry().get("attention", "flashinfer") is FlashInferAttention


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert FlashInferAttention.unavailable_reason() == (
        "needs CUDA (torch.cuda.is_available() is False)"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = fi_module.importlib.util.find_spec
    monkeypatch.setattr(
        fi_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a),
    )
    assert FlashInferAttention.unavailable_reason() == fi_module.INSTALL_HINT


def _spec(**kw) -> AttentionSpec:
    values = dict(
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    values.update(kw)
    return AttentionSpec(**values)


def test_building_it_unavailable_fails_with_one_line(unavailable):
    with pytest.raises(ValueError) as err:
        FlashInferAttention(spec=_spec())
    assert str(err.value) == f"attention 'flashinfer' cannot run here: {unavailable}"


def test_config_check_fails_with_one_line(unavailable):
    with pytest.raises(PluginError) as err:
        load_config(None, {"stack.attention": "flashinfer"})
    assert str(err.value) == f"attention 'flashinfer' cannot run here: {unavailable}"


def test_cli_config_and_serve_fail_with_one_line(unavailable, capsys):
    for command in ("config", "serve"):
        assert main([command, "--stack.attention", "flashinfer"]) == 2
        err = capsys.readouterr().err
        assert err == f"plugserve: error: attention 'flashinfer' cannot run here: {unavailable}\n"


def test_engine_start_fails_with_one_line(unavailable, tmp_path):
    """Past the config check (skipped here), the engine's ModelRunner builds the backend;
    its ValueError is what the engine process sends back as its one-line DEAD error."""
    from plugserve.worker.model_runner import ModelRunner
    from plugserve.worker.random_model import write_random_model

    folder = write_random_model(tmp_path / "tiny", "tiny", device="cpu")
    config = load_config(
        None, {"model": str(folder), "stack.attention": "flashinfer"}, check_plugins=False
    )
    with pytest.raises(ValueError, match=r"^attention 'flashinfer' cannot run here: [^\n]*$"):
        ModelRunner(config).initialize()


def test_offline_api_fails_before_loading_anything(unavailable):
    from plugserve import LLM

    with pytest.raises(PluginError, match="attention 'flashinfer' cannot run here"):
        LLM(model="/nonexistent/folder", attention="flashinfer")


# --------------------------------------------------------------------------- page table


def _batch(rows: list[tuple[int, int]], block_size: int, seed: int = 0) -> AttentionBatch:
    """rows: (context_len, query_len) each; blocks scattered over a shuffled pool."""
    rng = np.random.default_rng(seed)
    seq_lens = np.array([c + q for c, q in rows], dtype=np.int32)
    pages = -(-seq_lens // block_size)
    pool = rng.permutation(int(pages.sum()) + 8)
    # One spare column: tables are often wider than a row needs.
    table = np.zeros((len(rows), int(pages.max()) + 1), dtype=np.int32)
    taken = 0
    for i, n in enumerate(pages):
        table[i, :n] = pool[taken : taken + n]
        taken += n
    cu = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([q for _, q in rows], out=cu[1:])
    slots = []
    for i, (c, q) in enumerate(rows):
        pos = np.arange(c, c + q)
        slots.append(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return AttentionBatch(cu, seq_lens, table, np.concatenate(slots))


MIXED = [(0, 37), (0, 1), (5, 1), (15, 1), (16, 1), (17, 1), (100, 20), (31, 64), (250, 1)]


def test_paged_metadata_matches_a_per_row_walk():
    bs = 16
    batch = _batch(MIXED, bs)
    meta = paged_metadata(batch, bs)
    assert meta.qo_indptr.tolist() == batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        n = math.ceil(seq_len / bs)
        pages = meta.kv_indices[meta.kv_indptr[i] : meta.kv_indptr[i + 1]]
        assert pages.tolist() == batch.block_table[i, :n].tolist()
        assert meta.last_page_len[i] == seq_len - (n - 1) * bs
        assert 1 <= meta.last_page_len[i] <= bs
    assert {a.dtype for a in vars(meta).values()} == {np.dtype(np.int32)}


def test_padding_adds_scratch_rows_to_decode_batches_only():
    bs = 16
    decodes = _batch([(0, 1), (40, 1), (16, 1)], bs)
    padded = pad_decode_rows(paged_metadata(decodes, bs), 8, scratch_page=99)
    assert padded.qo_indptr.tolist() == list(range(9))
    assert padded.kv_indices[-5:].tolist() == [99] * 5
    assert np.diff(padded.kv_indptr)[-5:].tolist() == [1] * 5
    assert padded.last_page_len[-5:].tolist() == [1] * 5
    empty = paged_metadata(_batch([(0, 1)], bs), bs)
    assert pad_decode_rows(empty, 1, 7).kv_indices.tolist() == empty.kv_indices.tolist()
    with pytest.raises(ValueError, match="one-token rows"):
        pad_decode_rows(paged_metadata(_batch([(0, 3)], bs), bs), 4, 0)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_rows(paged_metadata(decodes, bs), 2, 0)


def test_metadata_rejects_a_table_too_short():
    batch = _batch([(40, 1)], 16)
    batch.block_table = batch.block_table[:, :2]
    with pytest.raises(ValueError, match="fewer blocks"):
        paged_metadata(batch, 16)


# --------------------------------------------------------------------------- on a GPU


def _run(backend, batch, q, k, v):
    backend.prepare(batch)
    return backend.forward(0, q, k, v)


@needs_flashinfer
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_the_torch_backend_on_a_mixed_batch(head_dim):
    from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

    torch.manual_seed(0)
    bs, num_blocks = 16, 64
    batch = _batch(MIXED, bs)
    spec = _spec(num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=bs)
    tokens = int(batch.query_start_loc[-1])
    q = torch.randn(tokens, 8, head_dim, device="cuda")
    k, v = torch.randn(2, tokens, 2, head_dim, device="cuda")
    context = torch.randn(1, 2, num_blocks, bs, 2, head_dim, device="cuda")

    reference = TorchPagedAttention(spec=_spec(**{**vars(spec), "dtype": torch.float32}))
    reference.allocate_kv_cache(num_blocks)
    reference.kv_cache.copy_(context)
    expected = _run(reference, batch, q, k, v)

    fi = FlashInferAttention(spec=spec)
    fi.allocate_kv_cache(num_blocks)
    fi.kv_cache[:, :, :num_blocks].copy_(context.to(torch.bfloat16))
    got = _run(fi, batch, q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    error = (got - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"
    # Both wrote the step's K/V at the same slots.
    torch.testing.assert_close(
        fi.kv_cache[:, :, :num_blocks].float(), reference.kv_cache.bfloat16().float()
    )


@needs_flashinfer
def test_graph_wrappers_match_the_eager_plan():
    torch.manual_seed(0)
    bs, num_blocks = 16, 64
    batch = _batch([(0, 1), (40, 1), (15, 1), (200, 1), (16, 1)], bs)
    spec = _spec(num_heads=8, num_kv_heads=2, head_dim=128, block_size=bs)
    q = torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 5, 2, 128, device="cuda", dtype=torch.bfloat16)
    fi = FlashInferAttention(spec=spec)
    fi.allocate_kv_cache(num_blocks)
    fi.kv_cache.normal_()
    eager = _run(fi, batch, q, k, v)
    fi.init_cuda_graphs([1, 8], max_blocks_per_req=32)
    fi.prepare_graph(batch, 8)
    pad = torch.zeros(3, *q.shape[1:], device="cuda", dtype=q.dtype)
    kpad = torch.zeros(3, *k.shape[1:], device="cuda", dtype=k.dtype)
    padded = fi.forward(0, torch.cat([q, pad]), torch.cat([k, kpad]), torch.cat([v, kpad]))
    torch.testing.assert_close(padded[:5], eager, atol=2e-2, rtol=2e-2)


def test_layer_options_become_flashinfer_plan_arguments():
    """window_left counts the keys left of the query (inclusive bound): a window of W
    tokens with the query is W - 1; -1 is no window."""
    assert plan_options(FULL_ATTENTION, 64) == {
        "sm_scale": 1 / math.sqrt(64),
        "window_left": -1,
        "logits_soft_cap": None,
    }
    layer = LayerAttention(sliding_window=4096, logit_softcap=50.0, scale=256**-0.5)
    assert plan_options(layer, 128) == {
        "sm_scale": 256**-0.5,
        "window_left": 4095,
        "logits_soft_cap": 50.0,
    }


@needs_flashinfer
def test_layer_options_match_the_torch_backend():
    """Layer 0 windowed (7 tokens), soft-capped and rescaled, layer 1 plain: each against
    the torch backend, which the CPU tests hold to the dense reference."""
    from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

    torch.manual_seed(0)
    bs, num_blocks, head_dim = 16, 64, 128
    batch = _batch(MIXED, bs)
    layers = (LayerAttention(sliding_window=7, logit_softcap=2.0, scale=0.05), FULL_ATTENTION)
    spec = _spec(num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=bs)
    spec = AttentionSpec(**{**vars(spec), "num_layers": 2, "layers": layers})
    tokens = int(batch.query_start_loc[-1])
    context = torch.randn(2, 2, num_blocks, bs, 2, head_dim, device="cuda")
    reference = TorchPagedAttention(spec=AttentionSpec(**{**vars(spec), "dtype": torch.float32}))
    reference.allocate_kv_cache(num_blocks)
    reference.kv_cache.copy_(context)
    fi = FlashInferAttention(spec=spec)
    fi.allocate_kv_cache(num_blocks)
    fi.kv_cache[:, :, :num_blocks].copy_(context.to(torch.bfloat16))
    reference.prepare(batch)
    fi.prepare(batch)
    for layer in range(2):
        q = torch.randn(tokens, 8, head_dim, device="cuda")
        k, v = torch.randn(2, tokens, 2, head_dim, device="cuda")
        expected = reference.forward(layer, q, k, v)
        got = fi.forward(layer, q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
        error = (got - expected).norm() / expected.norm()
        assert error < 1e-2, f"layer {layer}: relative error {error:.2e}"
