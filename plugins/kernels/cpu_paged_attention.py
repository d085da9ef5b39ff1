"""Builds and loads the C++ paged-attention kernel (cpu_paged_attention.cpp).

On CPU, attending a decode row through SDPA first copies its context out of the paged
cache (index_select), then reads the copy again; at batch 32 that copying and SDPA's
small-query overheads were a third of a decode step. The kernel reads K and V in place,
block by block, one query token per row; prefill tokens are rows too (causal by their
seq_len), which also beats SDPA's CPU kernel on short prompts.

It is compiled once per source, torch version and CPU into the plugserve cache with the
system C++ compiler ($CXX, else g++), against torch's own headers and OpenMP runtime;
where that fails the torch backend keeps SDPA and says why, once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from plugserve.worker.model_loader import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_state: dict[str, object] = {}


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compiler = os.environ.get("CXX", "g++")
    cmd = [
        *shlex.split(compiler),
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        f"-I{Path(sys.base_prefix) / 'include'}",
        str(_SOURCE),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        "-lgomp",
        f"-Wl,-rpath,{torch_lib}",
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes starting together
    # (data-parallel engines, tests) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            error = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(f"{compiler} failed: {error[0] if error else done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> bool:
    """Make torch.ops.plugserve_cpu.paged_attention available; False (with the reason
    logged once) if it cannot be built or loaded here."""
    if "ok" in _state:
        return bool(_state["ok"])
    key = hashlib.sha256(
        b"\0".join(
            [
                _SOURCE.read_bytes(),
                torch.__version__.encode(),
                platform.machine().encode(),
                _cpu_flags().encode(),
                " ".join(_FLAGS).encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_paged_attention-{key}.so"
    try:
        if not target.exists():
            logger.info("building the CPU paged-attention kernel (once): %s", target)
            _build(target)
        torch.ops.load_library(str(target))
        _state["ok"] = True
    except Exception as exc:  # no compiler, no headers, an unsupported platform
        logger.warning("CPU paged-attention kernel unavailable, using SDPA: %s", exc)
        _state["ok"] = False
    return bool(_state["ok"])


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only valid where it was built."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def paged_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_table: torch.Tensor,
    table_index: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row: q [R, H, D] attends to the first seq_lens[r] tokens of block-table
    row table_index[r]. K/V blocks [num_blocks, block_size, KVH, D]; block_table
    [requests, max_blocks], table_index and seq_lens [R], all int64 → [R, H, D]."""
    return torch.ops.plugserve_cpu.paged_attention(
        q, k_blocks, v_blocks, block_table, table_index, seq_lens, scale
    )
