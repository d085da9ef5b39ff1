"""How a model folder becomes a loaded torch module: its safetensors weights read into a
model class built on the target device in the target dtype, each linear layer run by the
linear method the chooser gives it (worker/linear_methods.py), then the selected model
passes applied (worker/model_passes.py).

Where the folder comes from (built-in names, GGUF conversion) is plugserve.model_files,
which every process can import without torch.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from plugserve.capabilities import builds_without_lm_head, supports_pipeline_stages
from plugserve.interfaces.model import LayerRoute
from plugserve.model_files import safetensors_files
from plugserve.worker.linear_methods import (
    LinearMethodChooser,
    give_linear_methods,
    process_linear_weights,
)
from plugserve.worker.model_passes import NamedPass, apply_model_passes

# A progress bar while weights load: where stderr is a terminal (for any but a tiny
# checkpoint), and in a log file only for a checkpoint this large (then at most one update
# every LOG_PROGRESS_INTERVAL_S), so that test and service logs stay clean.
LARGE_CHECKPOINT_BYTES = 4 << 30
TTY_PROGRESS_MIN_BYTES = 64 << 20
LOG_PROGRESS_INTERVAL_S = 10.0


def checkpoint_bytes(model_path: str | os.PathLike[str]) -> int:
    return sum(f.stat().st_size for f in safetensors_files(model_path))


def shows_progress(num_bytes: int, tty: bool | None = None) -> bool:
    """Whether loading a checkpoint of `num_bytes` shows a progress bar on stderr."""
    if tty is None:
        tty = sys.stderr.isatty()
    return num_bytes >= (TTY_PROGRESS_MIN_BYTES if tty else LARGE_CHECKPOINT_BYTES)


def with_progress(
    weights: Iterator[tuple[str, torch.Tensor]], num_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, with a tqdm bar of the bytes read so far on stderr."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    with tqdm(
        total=num_bytes,
        desc="Loading weights",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        mininterval=0.1 if tty else LOG_PROGRESS_INTERVAL_S,
        dynamic_ncols=tty,
    ) as bar:
        for name, tensor in weights:
            yield name, tensor
            bar.update(tensor.numel() * tensor.element_size())


def iter_weights(model_path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in the folder's weight files (those its
    safetensors index names, when it has one: model_files.safetensors_files)."""
    from safetensors import safe_open

    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
    "orthogonal_", "sparse_",
)  # fmt: skip


@contextlib.contextmanager
def _no_param_init(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    # Parameters are created directly on the target device in the target dtype, and the
    # random initializers they would run are skipped: load_weights overwrites them all.
    # Buffers computed in __init__ (RoPE tables) are real ops and stay correct, which a
    # meta-device build would lose. Patching is process-global, as transformers' own
    # no_init_weights is; models are built from one thread.
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    previous_dtype = torch.get_default_dtype()

    def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, skip)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous_dtype)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def accepts_parallel(model_cls: type[torch.nn.Module]) -> bool:
    """Whether `model_cls` can be built for a tensor-parallel rank: it takes `parallel=`,
    itself or through **kwargs passed on to its base (DecoderForCausalLM's subclasses)."""
    parameters = inspect.signature(model_cls).parameters.values()
    return any(p.name == "parallel" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def accepts_stage(model_cls: type[torch.nn.Module]) -> bool:
    """Whether `model_cls` can be built for one pipeline stage: it takes `stage=` (a
    worker.parallel.PipelineStage), itself or through **kwargs passed on to its base."""
    parameters = inspect.signature(model_cls).parameters.values()
    return any(p.name == "stage" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def load_model(
    model_path: str | os.PathLike[str],
    model_cls: type[torch.nn.Module],
    attention: Any,
    dtype: torch.dtype,
    device: torch.device,
    parallel: Any = None,
    linear_methods: LinearMethodChooser | None = None,
    model_passes: Sequence[NamedPass] = (),
    stage: Any = None,
    lm_head: bool = True,
) -> torch.nn.Module:
    """Build `model_cls(hf_config=..., attention=...)` on `device` in `dtype`, give its
    linear layers the methods `linear_methods` chooses (None: every layer keeps the plain
    one), load the folder's weights into it, process them and apply `model_passes`
    (finish_loading), and return it in eval mode. A tensor-parallel rank passes its
    ParallelContext, which the model class must then accept as `parallel=`; a pipeline
    stage its PipelineStage, accepted as `stage=`. `lm_head` False (a pooling runner)
    builds a class that can drop its head without it (capabilities.BuildsWithoutLmHead);
    a class that cannot has none to drop (an encoder)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_path))
    # Only passed when given, so architectures without tensor parallelism still load.
    extra = {} if parallel is None else {"parallel": parallel}
    if extra and not accepts_parallel(model_cls):
        raise ValueError(
            f"{model_cls.__name__} does not support tensor parallelism (no `parallel=` "
            "argument); use tensor_parallel_size=1"
        )
    if stage is not None:
        if not (supports_pipeline_stages(model_cls) and accepts_stage(model_cls)):
            raise ValueError(
                f"{model_cls.__name__} does not support pipeline parallelism "
                "(capabilities.SupportsPipelineStages); use pipeline_parallel_size=1"
            )
        extra["stage"] = stage
    if not lm_head and builds_without_lm_head(model_cls):
        extra["lm_head"] = False
    with _no_param_init(dtype, torch.device(device)):
        model = model_cls(hf_config=hf_config, attention=attention, **extra)
        if linear_methods is not None:  # their parameters, on the device in the dtype
            give_linear_methods(model, linear_methods)
    weights = iter_weights(model_path)
    num_bytes = checkpoint_bytes(model_path)
    first_rank = (parallel is None or parallel.rank == 0) and (stage is None or stage.is_first)
    if first_rank and shows_progress(num_bytes):
        weights = with_progress(weights, num_bytes)  # one bar, rank 0's
    model.load_weights(weights)  # type: ignore[operator]
    finish_loading(model, model_passes)
    return model.eval()


def finish_loading(
    model: torch.nn.Module, model_passes: Sequence[NamedPass] = ()
) -> list[LayerRoute]:
    """After the weights load: each linear method processes its layers (packing,
    quantizing), then `model_passes` rewrite how the layers run, in order (fusing layers
    over what the methods installed). Returns which path runs each layer and why (also
    logged)."""
    process_linear_weights(model)
    return apply_model_passes(model, model_passes)
