"""Linear layers for bfloat16 on CPU, with weights packed once at load.

Two kernels, picked once per machine (uses_own_kernel; PLUGSERVE_CPU_BF16_KERNEL=own or
onednn overrides the choice):

- cpu_gemm.cpp, on CPUs with AVX512_BF16 and no AMX: VDPBF16PS over a k-pair-interleaved
  copy of the weight (`pack_k_pairs`). It streams the weights at the memory bandwidth at
  decode sizes, where oneDNN does not (SmolLM2's matmuls on a 2-core Zen 5: 24 % faster
  at 1 row, 16 % at 32, equal at 512 to 2048 rows). Sums run in another order than
  `F.linear`'s, so results differ from it by fp32 rounding before the bf16 store.
- oneDNN elsewhere (and on AMX CPUs, whose tile kernels this one was never measured
  against): the weight is reordered once into oneDNN's blocked layout, since `F.linear`
  re-lays out a bf16 weight on every call; bit-identical to `F.linear`. For
  prefill-sized inputs the MLP then runs as oneDNN post-ops (FusedMLP): SiLU and
  gate * up applied to the fp32 accumulators inside the matmuls instead of separate bf16
  passes over [tokens, intermediate] tensors, a third of a 2048-token prefill's MLP.

float32 is never packed: the fp32 path keeps `F.linear`, bit for bit with Hugging Face.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import torch

from plugserve import ops

# Moved to plugserve.ops; re-exported here for one release, for plugins that took them
# from this module.
from plugserve.ops import HUGE_PAGE_BYTES, huge_page_buffer  # noqa: F401


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and (uses_own_kernel() or _onednn_bf16_supported())
    )


def _onednn_bf16_supported() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Overrides the choice of kernel for bf16 linears: "own" (cpu_gemm.cpp; an error where it
# cannot run), "onednn", or "auto" (the default: uses_own_kernel's choice for this CPU).
KERNEL_ENV = "PLUGSERVE_CPU_BF16_KERNEL"
_KERNEL_CHOICES = ("auto", "own", "onednn")
# What cpu_gemm.cpp's kernel needs of the CPU (cpu_gemm.h: PLUGSERVE_HAS_BF16_GEMM).
_OWN_KERNEL_CPU_FLAGS = ("avx512f", "avx512_bf16")


def uses_own_kernel() -> bool:
    """Whether bf16 linears run cpu_gemm.cpp here rather than oneDNN: the production
    choice. By default cpu_gemm.cpp wherever it can run (own_kernel_unavailable_reason)
    except on AMX CPUs, whose oneDNN tile kernels it was never measured against. The
    environment variable PLUGSERVE_CPU_BF16_KERNEL overrides it: "own" (a RuntimeError
    naming what is missing where cpu_gemm.cpp cannot run), "onednn", "auto" (the default).
    Tests force "own" to run the kernel on a CPU that prefers oneDNN."""
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in _KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected one of {', '.join(_KERNEL_CHOICES)}")
    if choice == "onednn" or (choice == "auto" and "amx_bf16" in _cpu_flags()):
        return False
    reason = own_kernel_unavailable_reason()  # builds and loads it on the first call
    if reason is not None and choice == "own":
        raise RuntimeError(f"{KERNEL_ENV}=own, but cpu_gemm.cpp cannot run here: {reason}")
    return reason is None


def own_kernel_unavailable_reason() -> str | None:
    """None where this machine can run cpu_gemm.cpp, whether or not uses_own_kernel
    prefers it here; else what is missing: "the CPU lacks avx512_bf16" (or avx512f), or
    "cpu_gemm.cpp cannot be built or loaded: ..." with the compiler's or loader's error.
    On the first call where the CPU has what it needs, builds and loads the library, and
    turns its row pool on where openmp_spins_briefly."""
    flags = _cpu_flags()
    missing = [flag for flag in _OWN_KERNEL_CPU_FLAGS if flag not in flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    return _load_own_kernel()


def _cpu_flags() -> list[str]:
    return ops.cpu_flags().split()


@cache
def _load_own_kernel() -> str | None:
    """Builds and loads cpu_gemm.cpp; None where its kernel is then there, else why not."""
    error = ops.unavailable_reason(ops.GEMM_SOURCE)
    if error is not None:
        return f"cpu_gemm.cpp cannot be built or loaded: {error}"
    if not hasattr(torch.ops.plugserve_gemm, "linear_bf16"):
        return (
            "cpu_gemm.cpp was built without its kernel "
            "(the compiler's -march=native does not enable AVX512_BF16)"
        )
    if openmp_spins_briefly():
        torch.ops.plugserve_gemm.row_pool_set_enabled(True)
    return None


def describe_bf16_path(coded_weights: bool) -> str:
    """One line for the start-up log: which kernel bf16 linears run here, and whether
    one-row steps read exponent-coded copies and share their work with the helper thread
    (whose use also needs more than one torch thread)."""
    if not _onednn_bf16_supported() and not uses_own_kernel():
        return "F.linear (no packed bf16 kernel on this CPU)"
    if not uses_own_kernel():
        return "oneDNN, packed once"
    coded = "exponent-coded copies" if coded_weights else "packed weights (coding off)"
    pool = torch.ops.plugserve_gemm.row_pool_enabled() and torch.get_num_threads() > 1
    helper = "shared with the helper thread" if pool else "on the calling threads only"
    return f"cpu_gemm.cpp; one-row steps read {coded}, {helper}"


# At most this many turns of spinning after a parallel region (GNU OpenMP's default is
# 300000, milliseconds here) for the one-row matmuls to use their helper thread.
_BRIEF_SPIN_COUNT = 20000


def openmp_spins_briefly() -> bool:
    """Whether this process started with OpenMP's threads spinning only briefly after a
    parallel region (GOMP_SPINCOUNT, read when OpenMP loads): engine processes do
    (plugserve.ops.process_env). Only then do one-row matmuls share their blocks with the
    helper thread of row_pool.h: a spinning OpenMP thread would starve it."""
    try:
        return int(os.environ.get("GOMP_SPINCOUNT", "")) <= _BRIEF_SPIN_COUNT
    except ValueError:
        return False


def k_pairs_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    return (-(-out_features // 16), in_features // 2, 16, 2)


def pack_k_pairs(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] weight (K even) → [N/16 blocks, K/2, 16, 2]: each 64-byte row holds a pair of
    consecutive k for 16 output columns, the operand VDPBF16PS takes. N is padded to a
    whole block with zero rows. Written into `out` (that shape) where given."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight.detach()
    pairs = padded.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3)
    return pairs.contiguous() if out is None else out.copy_(pairs)


# The exponent-coded copy of a packed weight (cpu_gemm.h, row_block_coded): per 16-column
# block a 64-byte table of its exponents, then 96 bytes per two k-pairs.
CODED_TABLE_BYTES = 64
CODED_GROUP_BYTES = 96


def coded_block_bytes(in_features: int) -> int:
    """Bytes of one 16-column block's record, for a weight of `in_features` inputs."""
    return CODED_TABLE_BYTES + in_features // 4 * CODED_GROUP_BYTES


def exponent_codable(in_features: int) -> bool:
    """Whether a weight with this many input features can have an exponent-coded copy
    (whole groups of two k-pairs)."""
    return in_features % 4 == 0


def code_exponents(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A k-pair-packed bf16 weight [N/16, K/2, 16, 2] (K divisible by 4) → its lossless
    exponent-coded copy, uint8 [N/16, coded_block_bytes(K)], which one-row matmuls read
    instead: 12 bits a weight (a 4-bit index into the block's own table of exponents, and
    a byte of sign and mantissa) where a block's 16 columns use at most 16 exponents, as
    ~97 % of SmolLM2's blocks do; the others are marked uncoded and read from `packed`.
    Written into `out` where given."""
    if (reason := own_kernel_unavailable_reason()) is not None:
        raise RuntimeError(
            f"exponent-coded weights need cpu_gemm.cpp, which cannot run here: {reason}"
        )
    blocks, pairs = packed.shape[0], packed.shape[1]
    if out is None:
        out = torch.empty(blocks, coded_block_bytes(2 * pairs), dtype=torch.uint8)
    torch.ops.plugserve_gemm.code_exponents(packed, out)
    return out


_EXPONENT_CODING: ContextVar[bool] = ContextVar("plugserve_exponent_coding", default=False)


@contextmanager
def exponent_coding(enabled: bool) -> Iterator[None]:
    """Within this block, arenas made by WeightArena.for_weights also hold each packed
    weight's exponent-coded copy (code_exponents), which one-row matmuls then read:
    ~25 % fewer bytes a batch-1 step, for 75 % more memory for the weights."""
    token = _EXPONENT_CODING.set(enabled)
    try:
        yield
    finally:
        _EXPONENT_CODING.reset(token)


class WeightArena:
    """One huge-page buffer for a model's k-pair-packed weights, handed out in the order
    they are packed (a step's order, so one step reads the buffer front to back), and
    optionally a second one for their exponent-coded copies, in the same order."""

    def __init__(self, weight_shapes: list[tuple[int, int]], coded: bool = False) -> None:
        numel = sum(math.prod(k_pairs_shape(*shape)) for shape in weight_shapes)
        self._buffer = huge_page_buffer(2 * numel).view(torch.bfloat16)
        self._offset = 0
        coded_bytes = sum(
            _coded_bytes(*shape) for shape in weight_shapes if exponent_codable(shape[1])
        )
        self._coded = huge_page_buffer(coded_bytes) if coded and coded_bytes else None
        self._coded_offset = 0

    @classmethod
    def for_weights(cls, weights: list[torch.Tensor]) -> WeightArena | None:
        """An arena for the weights this machine packs for cpu_gemm; None where it packs
        none (oneDNN does its own layout). With coded copies inside exponent_coding(True)."""
        shapes = [
            (w.shape[0], w.shape[1])
            for w in weights
            if packs_k_pairs(w.dtype, w.device, w.shape[1])
        ]
        return cls(shapes, coded=_EXPONENT_CODING.get()) if shapes else None

    def packed(self) -> torch.Tensor:
        """Every weight handed out so far, as one bf16 tensor: what a batch-1 step reads
        without coded copies (the bf16 bytes its floor is measured on)."""
        return self._buffer[: self._offset]

    def take(self, out_features: int, in_features: int) -> torch.Tensor:
        shape = k_pairs_shape(out_features, in_features)
        numel = math.prod(shape)
        if self._offset + numel > self._buffer.numel():
            raise ValueError(f"weight arena full: no room for a {shape} packed weight")
        view = self._buffer[self._offset : self._offset + numel].view(shape)
        self._offset += numel
        return view

    def take_coded(self, out_features: int, in_features: int) -> torch.Tensor | None:
        """Room for this weight's coded copy; None where the arena holds none or the weight
        cannot be coded."""
        if self._coded is None or not exponent_codable(in_features):
            return None
        size = _coded_bytes(out_features, in_features)
        if self._coded_offset + size > self._coded.numel():
            raise ValueError("weight arena full: no room for a coded weight")
        view = self._coded[self._coded_offset : self._coded_offset + size]
        self._coded_offset += size
        return view.view(-(-out_features // 16), -1)


def _coded_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // 16) * coded_block_bytes(in_features)


def packs_k_pairs(dtype: torch.dtype, device: torch.device, in_features: int) -> bool:
    """Whether a weight of this kind is packed for cpu_gemm.cpp (else oneDNN or none)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and in_features % 2 == 0
        and uses_own_kernel()
    )


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight → an opaque oneDNN-packed tensor for _linear_pointwise."""
    # Any batch-size hint picks a layout that runs prefill-sized inputs (128 rows) ~20%
    # faster than the hint-less default, and decode sizes no slower (measured, torch 2.13).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear:
    """x [T, in] → x @ weight.T + bias, through whichever kernel this machine uses."""

    __slots__ = ("bias", "coded", "out_features", "own_kernel", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        arena: WeightArena | None = None,
    ) -> None:
        """`arena`, where given, holds the packed copy (the own kernel's layout only), and
        the exponent-coded one where it holds those."""
        self.out_features, in_features = weight.shape
        self.own_kernel = packs_k_pairs(weight.dtype, weight.device, in_features)
        self.coded: torch.Tensor | None = None
        if self.own_kernel:
            out = None if arena is None else arena.take(self.out_features, in_features)
            self.weight = pack_k_pairs(weight, out)
            self.bias = None if bias is None else bias.detach().float().contiguous()
            coded = None if arena is None else arena.take_coded(self.out_features, in_features)
            if coded is not None:
                self.coded = code_exponents(self.weight, coded)
        else:
            self.weight = pack_onednn(weight)
            self.bias = bias

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype=torch.float32 asks for fp32 (the LM head's logits): the own kernel
        writes its sums unrounded, oneDNN's bf16 result is converted."""
        if self.own_kernel:
            return torch.ops.plugserve_gemm.linear_bf16(
                x, self.weight, self.out_features, self.bias, out_dtype, self.coded
            )
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out if out_dtype is None else out.to(out_dtype)


# Below this many tokens the MLP keeps one fused gate-up matmul and separate passes.
FUSED_MLP_MIN_TOKENS = 128


class FusedMLP:
    """down(silu(gate(x)) * up(x)) in three oneDNN matmuls, SiLU and * up as post-ops."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate = pack_onednn(gate.contiguous())
        self.up = pack_onednn(up.contiguous())
        self.down = pack_onednn(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        activated = ops._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = ops._linear_pointwise.binary(x, activated, self.up, None, "mul")
        return ops._linear_pointwise(hidden, self.down, None, "none", [], "")
