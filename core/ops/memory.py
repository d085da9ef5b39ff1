"""Memory for buffers that kernels stream through once a step (packed weights, the KV
cache): aligned so that Linux can back them with 2 MB pages."""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `num_bytes` starting on a 2 MB boundary, which Linux backs with
    transparent huge pages where it allows them (THP "always" or "madvise").

    A decode step streams every weight once. On 4 KB pages that is a TLB miss every 4 KB
    and the hardware prefetchers restart at each page; on 2 MB pages SmolLM2's 269 MB of
    weights read 7 % faster (3.8 vs 4.1 ms at a 75 GB/s phase of this VM)."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or num_bytes == 0:  # not Linux: ordinary pages
        return torch.empty(num_bytes, dtype=torch.uint8)
    # Private: shared anonymous memory is shmem, which THP's madvise mode leaves alone.
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    region.madvise(advise)  # before the first touch, which is when pages are chosen
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + num_bytes]
