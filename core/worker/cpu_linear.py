"""Linear layers for bfloat16 on CPU, with weights laid out once at load for their kernels.

Three kernel libraries, each call picked by its row count (kernel_plan.py: the buckets
and the plan; kernel_choice.py: the plan measured per machine):

- cpu_gemm.cpp, on CPUs with AVX512_BF16: VDPBF16PS over a k-pair-interleaved copy of the
  weight (`pack_k_pairs`). It streams the weights at the memory bandwidth at decode sizes,
  where oneDNN does not (SmolLM2's matmuls on a 2-core Zen 4: 24 % faster at 1 row, 16 % at
  32). Sums run in another order than `F.linear`'s, so results differ from it by fp32
  rounding before the bf16 store. One row can read a lossless exponent-coded copy. On AMX
  CPUs the same packed weights also run on AMX tiles (cpu_gemm_amx.h), which win batches.
- oneDNN: the weight is reordered once into oneDNN's blocked layout, since `F.linear`
  re-lays out a bf16 weight on every call; bit-identical to `F.linear`. On AMX CPUs its
  tile kernels win batches and prefill (SmolLM2 at 32 rows on a 2-core Xeon: 17.6 ms
  against cpu_gemm's 36). For prefill chunks the MLP may run as oneDNN post-ops
  (FusedMLP).
- ATen's `F.linear` over the weight as loaded.

float32 is never packed: the fp32 path keeps `F.linear`, bit for bit with Hugging Face.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from functools import cache

import torch
import torch.nn.functional as F

from plugserve import ops
from plugserve.ops import huge_page_buffer
from plugserve.worker.kernel_plan import (
    AMX,
    KERNELS_BY_NAME,
    ROW_BUCKETS,
    TILED,
    Kernel,
    KernelPlan,
    Library,
    bucket_index,
)


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and (own_kernel_unavailable_reason() is None or _onednn_bf16_supported())
    )


def _onednn_bf16_supported() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# Restricts the kernels bf16 linears may run: "own" (cpu_gemm.cpp; an error where it cannot
# run), "onednn", "aten", or "auto" (the default: whichever measures fastest, per bucket);
# or sets the plan: one kernel name per row bucket, comma-separated
# ("own/tiled,own,onednn,onednn,onednn/fused-mlp"), unmeasured.
KERNEL_ENV = "PLUGSERVE_CPU_BF16_KERNEL"
_KERNEL_CHOICES = ("auto", "own", "onednn", "aten")


def _kernel_setting() -> str:
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in _KERNEL_CHOICES and "," not in choice:
        raise ValueError(
            f"{KERNEL_ENV}={choice!r}: expected one of {', '.join(_KERNEL_CHOICES)}, or one "
            f"kernel per row bucket ({', '.join(b.name for b in ROW_BUCKETS)}) from "
            f"{', '.join(KERNELS_BY_NAME)}, comma-separated"
        )
    return choice


def forced_plan() -> KernelPlan | None:
    """The plan PLUGSERVE_CPU_BF16_KERNEL sets, where it names one kernel per bucket."""
    choice = _kernel_setting()
    if "," not in choice:
        return None
    names = [name.strip() for name in choice.split(",")]
    unknown = [name for name in names if name not in KERNELS_BY_NAME]
    if len(names) != len(ROW_BUCKETS) or unknown:
        raise ValueError(
            f"{KERNEL_ENV}={choice!r}: expected {len(ROW_BUCKETS)} kernels (rows "
            f"{', '.join(b.name for b in ROW_BUCKETS)}) from {', '.join(KERNELS_BY_NAME)}"
        )
    return KernelPlan(tuple(KERNELS_BY_NAME[name] for name in names))


# What cpu_gemm.cpp's kernel needs of the CPU (cpu_gemm.h: PLUGSERVE_HAS_BF16_GEMM).
OWN_KERNEL_CPU_FLAGS = ("avx512f", "avx512_bf16")


def allowed_libraries() -> tuple[Library, ...]:
    """The kernel libraries bf16 linears may use here: every one that runs on this machine,
    or the one PLUGSERVE_CPU_BF16_KERNEL names ("own" raises a RuntimeError naming what is
    missing where cpu_gemm.cpp cannot run). Tests force "own" or "onednn" to run a kernel
    the machine would not pick."""
    choice = _kernel_setting()
    reason = own_kernel_unavailable_reason()  # builds and loads it on the first call
    plan = forced_plan()
    if plan is not None:
        if "own" in plan.libraries() and reason is not None:
            raise RuntimeError(f"{KERNEL_ENV} names cpu_gemm.cpp, which cannot run here: {reason}")
        return tuple(lib for lib in ("own", "onednn", "aten") if lib in plan.libraries())
    if choice == "own":
        if reason is not None:
            raise RuntimeError(f"{KERNEL_ENV}=own, but cpu_gemm.cpp cannot run here: {reason}")
        return ("own",)
    if choice == "onednn":
        if not _onednn_bf16_supported():
            raise RuntimeError(f"{KERNEL_ENV}=onednn, but oneDNN has no bf16 kernel here")
        return ("onednn",)
    if choice == "aten":
        return ("aten",)
    available: list[Library] = ["own"] if reason is None else []
    if _onednn_bf16_supported():
        available.append("onednn")
    return (*available, "aten")


def default_plan() -> KernelPlan:
    """The plan of a PackedLinear built without one (outside a model: tests, tools): one
    kernel for every row count, the first allowed of cpu_gemm.cpp, oneDNN, ATen. A model's
    own plan is measured (kernel_choice.py)."""
    library = allowed_libraries()[0]
    return forced_plan() or KernelPlan.single(KERNELS_BY_NAME[library])


def own_kernel_unavailable_reason() -> str | None:
    """None where this machine can run cpu_gemm.cpp, whether or not a plan picks it
    here; else what is missing: "the CPU lacks avx512_bf16" (or avx512f), or
    "cpu_gemm.cpp cannot be built or loaded: ..." with the compiler's or loader's error.
    On the first call where the CPU has what it needs, builds and loads the library, and
    turns its row pool on where openmp_spins_briefly."""
    flags = _cpu_flags()
    missing = [flag for flag in OWN_KERNEL_CPU_FLAGS if flag not in flags]
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


def describe_bf16_path(plan: KernelPlan) -> str:
    """One line for the start-up log: which kernel each row bucket runs, and whether
    one-row steps share their work with the helper thread (which also needs more than one
    torch thread)."""
    line = plan.describe()
    one_row = plan.by_bucket[0]
    if one_row.library == "own" and one_row.one_row_mode != TILED:
        pool = torch.ops.plugserve_gemm.row_pool_enabled() and torch.get_num_threads() > 1
        line += "; one-row cpu_gemm steps " + (
            "shared with the helper thread" if pool else "on the calling threads only"
        )
    return line


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
    ~96 % of SmolLM2's layer blocks do (76 % of its down_proj's); the others are marked
    uncoded and hold their first k-pairs plain, as many as the record has room for (3/4),
    the rest read from `packed`.
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


def amx_available() -> bool:
    """Whether cpu_gemm.cpp runs AMX tiles here (built for AMX-BF16, allowed by the OS)."""
    return own_kernel_unavailable_reason() is None and bool(
        torch.ops.plugserve_gemm.amx_available()
    )


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
    def for_weights(
        cls, weights: list[torch.Tensor], plan: KernelPlan | None = None
    ) -> WeightArena | None:
        """An arena for the weights `plan` (default_plan where None) runs on cpu_gemm, with
        their coded copies where its one-row kernel reads them; None where it packs none
        (oneDNN and ATen keep their own layouts)."""
        plan = plan or default_plan()
        shapes = [
            (w.shape[0], w.shape[1])
            for w in weights
            if "own" in plan.libraries() and packs_k_pairs(w.dtype, w.device, w.shape[1])
        ]
        return cls(shapes, coded=plan.coded) if shapes else None

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
    """Whether cpu_gemm.cpp can run a weight of this kind (else oneDNN or ATen do)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and in_features % 2 == 0
        and own_kernel_unavailable_reason() is None
    )


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight → an opaque oneDNN-packed tensor for _linear_pointwise."""
    # Any batch-size hint picks a layout that runs prefill-sized inputs (128 rows) ~20%
    # faster than the hint-less default, and decode sizes no slower (measured, torch 2.13).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear:
    """x [T, in] → x @ weight.T + bias, each call through the kernel that `plan` gives its
    row count (default_plan where None). Holds the layout of every kernel the plan uses,
    or of every kernel in `kernels` where given (to time them with `run`): cpu_gemm's
    k-pair-packed copy (in `arena` where given) and its exponent-coded one, oneDNN's
    blocked one, or the weight as loaded for ATen. Where cpu_gemm cannot take the weight
    (an odd number of inputs), its buckets run oneDNN, else ATen."""

    __slots__ = (
        "_calls",
        "bias",
        "coded",
        "in_features",
        "onednn_weight",
        "out_features",
        "own_bias",
        "plain_weight",
        "plan",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        arena: WeightArena | None = None,
        plan: KernelPlan | None = None,
        kernels: Collection[Kernel] | None = None,
    ) -> None:
        self.out_features, in_features = weight.shape
        self.in_features = in_features
        own_runs = packs_k_pairs(weight.dtype, weight.device, in_features)
        plan = _runnable_plan(plan or default_plan(), own_runs, in_features)
        self.plan = plan
        kernels = plan.by_bucket if kernels is None else kernels
        wanted = {_runnable(k, own_runs, in_features) for k in kernels}
        libraries = {kernel.library for kernel in wanted}
        self.bias = bias
        self.weight: torch.Tensor | None = None  # cpu_gemm's k-pair layout
        self.own_bias: torch.Tensor | None = None
        self.coded: torch.Tensor | None = None
        if "own" in libraries:
            out = None if arena is None else arena.take(self.out_features, in_features)
            self.weight = pack_k_pairs(weight, out)
            self.own_bias = None if bias is None else bias.detach().float().contiguous()
            if any(kernel.coded for kernel in wanted):
                coded = self._coded_room(arena, in_features)
                if coded is not None or (arena is None and exponent_codable(in_features)):
                    self.coded = code_exponents(self.weight, coded)
        self.onednn_weight = pack_onednn(weight) if "onednn" in libraries else None
        self.plain_weight = weight.detach() if "aten" in libraries else None
        self._calls = tuple(self._call_for(kernel) for kernel in plan.by_bucket)

    def _coded_room(self, arena: WeightArena | None, in_features: int) -> torch.Tensor | None:
        return None if arena is None else arena.take_coded(self.out_features, in_features)

    @property
    def own_kernel(self) -> bool:
        """Whether this weight has cpu_gemm's layout (which the fused decoder reads)."""
        return self.weight is not None

    def _call_for(self, kernel: Kernel) -> Callable[..., torch.Tensor]:
        if kernel.library == "own":
            linear_bf16 = torch.ops.plugserve_gemm.linear_bf16
            weight, n, bias, mode = (
                self.weight,
                self.out_features,
                self.own_bias,
                kernel.one_row_mode,
            )
            coded = self.coded if kernel.coded else None
            return lambda x, out_dtype=None: linear_bf16(x, weight, n, bias, out_dtype, coded, mode)
        if kernel.library == "onednn":
            pointwise, onednn_weight, bias = (
                torch.ops.mkldnn._linear_pointwise,
                self.onednn_weight,
                self.bias,
            )

            def onednn(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
                out = pointwise(x, onednn_weight, bias, "none", [], "")
                return out if out_dtype is None else out.to(out_dtype)

            return onednn
        plain, bias = self.plain_weight, self.bias

        def aten(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
            out = F.linear(x, plain, bias)
            return out if out_dtype is None else out.to(out_dtype)

        return aten

    def run(
        self, kernel: Kernel, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x through `kernel` whatever the plan says (a kernel whose layout this holds; as
        at construction, one that cannot take this weight stands in for another)."""
        own_runs = self.weight is not None
        return self._call_for(_runnable(kernel, own_runs, self.in_features))(x, out_dtype)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype=torch.float32 asks for fp32 (the LM head's logits): cpu_gemm writes its
        sums unrounded, the others' bf16 result is converted."""
        return self._calls[bucket_index(x.shape[0])](x, out_dtype)


def _runnable(kernel: Kernel, own_runs: bool, in_features: int) -> Kernel:
    """`kernel`, or where it is cpu_gemm's and cpu_gemm cannot take the weight, oneDNN
    (ATen where oneDNN has no bf16 kernel); AMX tiles where K is no multiple of 32, the
    vector kernel."""
    if kernel.library != "own":
        return kernel
    if not own_runs:
        return KERNELS_BY_NAME["onednn" if _onednn_bf16_supported() else "aten"]
    if kernel.one_row_mode == AMX and in_features % 32 != 0:
        return KERNELS_BY_NAME["own"]
    return kernel


def _runnable_plan(plan: KernelPlan, own_runs: bool, in_features: int) -> KernelPlan:
    return KernelPlan(tuple(_runnable(k, own_runs, in_features) for k in plan.by_bucket))


class FusedMLP:
    """down(silu(gate(x)) * up(x)) in three oneDNN matmuls, SiLU and * up as post-ops:
    applied to the fp32 accumulators inside the matmuls instead of separate bf16 passes
    over [tokens, intermediate] tensors (a third of a 2048-token prefill's MLP)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate = pack_onednn(gate.contiguous())
        self.up = pack_onednn(up.contiguous())
        self.down = pack_onednn(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        activated = ops._linear_pointwise(x, self.gate, None, "swish", [], "")
        hidden = ops._linear_pointwise.binary(x, activated, self.up, None, "mul")
        return ops._linear_pointwise(hidden, self.down, None, "none", [], "")
