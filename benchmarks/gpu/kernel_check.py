"""(a) FlashInfer against the torch backend on fresh random paged inputs, bf16.

Each trial draws a new mixed batch (fresh prefills, prefill chunks after cached context,
decodes at and around page boundaries and deep into long contexts) over a shuffled
block pool, with a seed printed for replay. Both backends get the same bf16 inputs; the
reference is the torch backend in fp32 on those same (bf16-rounded) values, so the
errors measure each kernel's own arithmetic. FlashInfer passes when its relative error
is below 1e-2 and within 3x (+1e-3) of the torch backend's own bf16 error, when it
writes exactly the same K/V into the cache, and when its CUDA-graph path (decode rows
padded to a captured size) agrees with its eager plan.

    python benchmarks/gpu/kernel_check.py check [--trials 3] [--seed N]
    python benchmarks/gpu/kernel_check.py warmup --head-dim 128   # JIT-compile only
"""

from __future__ import annotations

import argparse
import time

import common
import numpy as np
import torch

from plugserve.interfaces.model import AttentionBatch, AttentionSpec
from plugserve_plugins.kernels.flashinfer import FlashInferAttention
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

BLOCK_SIZE = 16
SHAPES = [(32, 8, 128), (32, 8, 64), (16, 16, 128)]  # (heads, kv heads, head dim)


def random_rows(rng: np.random.Generator, num_rows: int) -> list[tuple[int, int]]:
    """(context_len, query_len) per row: a third each fresh prefills, chunks after
    context, decodes; plus decodes right at page boundaries."""
    rows = []
    for i in range(num_rows):
        kind = i % 3
        if kind == 0:
            rows.append((0, int(rng.integers(1, 300))))
        elif kind == 1:
            rows.append((int(rng.integers(1, 1000)), int(rng.integers(2, 200))))
        else:
            rows.append((int(rng.integers(0, 2000)), 1))
    rows += [(15, 1), (16, 1), (31, 1), (32, 1)]
    return [rows[i] for i in rng.permutation(len(rows))]


def paged_batch(rows, rng: np.random.Generator) -> tuple[AttentionBatch, int]:
    seq_lens = np.array([c + q for c, q in rows], dtype=np.int32)
    pages = -(-seq_lens // BLOCK_SIZE)
    num_blocks = int(pages.sum()) + 16
    pool = rng.permutation(num_blocks)
    table = np.zeros((len(rows), int(pages.max())), dtype=np.int32)
    cu = np.zeros(len(rows) + 1, dtype=np.int32)
    slots, taken = [], 0
    for i, ((context, query), n) in enumerate(zip(rows, pages, strict=True)):
        table[i, :n] = pool[taken : taken + n]
        taken += n
        cu[i + 1] = cu[i] + query
        pos = np.arange(context, context + query)
        slots.append(table[i, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
    return AttentionBatch(cu, seq_lens, table, np.concatenate(slots)), num_blocks


def spec(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionSpec:
    return AttentionSpec(1, heads, kv_heads, head_dim, BLOCK_SIZE, dtype, torch.device("cuda"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def trial(shape: tuple[int, int, int], seed: int) -> dict:
    heads, kv_heads, head_dim = shape
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    rows = random_rows(rng, 24)
    batch, num_blocks = paged_batch(rows, rng)
    tokens = int(batch.query_start_loc[-1])
    bf = torch.bfloat16
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=bf)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, device="cuda", dtype=bf)
    context = torch.randn(1, 2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=bf)

    def run(backend, dtype):
        backend.allocate_kv_cache(num_blocks)
        backend.kv_cache[:, :, :num_blocks].copy_(context)
        backend.prepare(batch)
        return backend.forward(0, q.to(dtype), k.to(dtype), v.to(dtype))

    reference = run(TorchPagedAttention(spec=spec(*shape, torch.float32)), torch.float32)
    torch_bf16 = run(TorchPagedAttention(spec=spec(*shape, bf)), bf)
    fi = FlashInferAttention(spec=spec(*shape, bf))
    got = run(fi, bf)
    torch.cuda.synchronize()
    written = batch.slot_mapping
    kv_exact = bool(
        torch.equal(
            fi.kv_cache[0, :, :num_blocks].reshape(2, -1, kv_heads, head_dim)[:, written],
            torch.stack([k, v]),
        )
    )
    # The graph path on this batch's decode rows, padded to the next multiple of 16.
    decode_rows = np.flatnonzero(np.diff(batch.query_start_loc) == 1)
    token_of_row = batch.query_start_loc[:-1][decode_rows]
    decodes = AttentionBatch(
        np.arange(len(decode_rows) + 1, dtype=np.int32),
        batch.seq_lens[decode_rows],
        batch.block_table[decode_rows],
        batch.slot_mapping[token_of_row],
    )
    padded = -(-len(decode_rows) // 16) * 16
    fi.init_cuda_graphs([padded], max_blocks_per_req=batch.block_table.shape[1])
    fi.prepare_graph(decodes, padded)
    idx = torch.from_numpy(token_of_row.astype(np.int64)).cuda()
    extra = padded - len(decode_rows)

    def pad(x):
        return torch.cat([x[idx], x.new_zeros(extra, *x.shape[1:])])

    graph_out = fi.forward(0, pad(q), pad(k), pad(v))[: len(decode_rows)]
    result = {
        "shape": list(shape),
        "seed": seed,
        "rows": len(rows),
        "tokens": tokens,
        "rel_err_flashinfer": rel(got, reference),
        "rel_err_torch_bf16": rel(torch_bf16, reference),
        "max_abs_err_flashinfer": float((got.float() - reference).abs().max()),
        "rel_err_graph_vs_eager": rel(graph_out, got[idx]),
        "kv_written_exactly": kv_exact,
    }
    fi_err, torch_err = result["rel_err_flashinfer"], result["rel_err_torch_bf16"]
    result["passed"] = bool(
        fi_err < 1e-2
        and fi_err <= 3 * torch_err + 1e-3
        and result["rel_err_graph_vs_eager"] < 1e-2
        and kv_exact
    )
    return result


def check(trials: int, seed: int | None) -> int:
    base = seed if seed is not None else time.time_ns() % (1 << 31)
    print(f"(a) kernels: base seed {base} (fresh unless --seed)", flush=True)
    results = []
    for shape in SHAPES:
        for t in range(trials):
            r = trial(shape, base + 1000 * t + sum(shape))
            results.append(r)
            print(
                f"  heads {shape[0]}/{shape[1]} dim {shape[2]} seed {r['seed']}: "
                f"flashinfer {r['rel_err_flashinfer']:.2e} torch-bf16 {r['rel_err_torch_bf16']:.2e} "
                f"graph-vs-eager {r['rel_err_graph_vs_eager']:.2e} kv-exact {r['kv_written_exactly']}"
                f" -> {'ok' if r['passed'] else 'FAIL'}",
                flush=True,
            )
    passed = all(r["passed"] for r in results)
    common.save("kernels", {"passed": passed, "base_seed": base, "trials": results})
    return 0 if passed else 1


def warmup(head_dim: int) -> int:
    """Plan and run once for Llama's 32/8 heads at `head_dim`: JIT-compiles the module
    into FlashInfer's cache so that later processes only load it."""
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    batch, num_blocks = paged_batch([(0, 40), (20, 1)], rng)
    fi = FlashInferAttention(spec=spec(32, 8, head_dim, torch.bfloat16))
    fi.allocate_kv_cache(num_blocks)
    fi.prepare(batch)
    q = torch.zeros(41, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(41, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    fi.forward(0, q, kv, kv)
    torch.cuda.synchronize()
    print(f"flashinfer head_dim {head_dim} ready in {time.perf_counter() - start:.0f} s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=None)
    p = sub.add_parser("warmup")
    p.add_argument("--head-dim", type=int, required=True)
    args = parser.parse_args()
    if args.command == "warmup":
        return warmup(args.head_dim)
    return check(args.trials, args.seed)


if __name__ == "__main__":
    raise SystemExit(main())
