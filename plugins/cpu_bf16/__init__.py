"""The bf16 CPU fast path, one bundled plugin (docs/cpu-fast-path.md):

- the `cpu_bf16` linear method (linear_method.py): every linear weight packed for the
  kernel its measured plan gives each row count (cpu_gemm.cpp, on AMX tiles where the CPU
  has them; oneDNN; ATen), with exponent-coded copies for one-row steps as an option;
  what bf16 on a CPU runs unless `stack.linear_method` names another;
- the `fused_cpu_decoder` model pass (fused_decoder.py): each decoder layer it can run as
  one fused function over core's small CPU ops, and the whole stack as one C++ op where
  every linear runs cpu_gemm.cpp; applied by default (config.AUTOMATIC_MODEL_PASSES);
- the `fused_cpu_encoder` model pass (fused_encoder.py): a BERT-style encoder's layers,
  each as one C++ op between the attention backend's calls; applied by default too.

Its modules: cpu_features.py (what the machine offers), kernel_plan.py / kernel_choice.py
/ kernel_setting.py (which kernel runs each row count, and measuring it), weight_arena.py
/ exponent_coding.py / packed_linear.py / fused_mlp.py (the weights' layouts and their
calls), fused_layer.py / fused_stack.py (the fused decoder), fused_encoder.py (the fused
encoder); C++: cpu_gemm.cpp with cpu_gemm.h and cpu_gemm_amx.h, cpu_decoder.cpp,
cpu_encoder.cpp, built by plugserve.ops against its public
headers.

Registered by "module:Class" reference: the API-server process loads this module with
every plugin, and must not import the worker code the classes are written against.
"""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.hookspecs import Register


@hookimpl
def register_linear_methods(register: Register) -> None:
    register("cpu_bf16", "plugserve_plugins.cpu_bf16.linear_method:PackedCpuBf16")


@hookimpl
def register_model_passes(register: Register) -> None:
    register("fused_cpu_decoder", "plugserve_plugins.cpu_bf16.fused_decoder:FusedCpuDecoderPass")
    register("fused_cpu_encoder", "plugserve_plugins.cpu_bf16.fused_encoder:FusedCpuEncoderPass")
