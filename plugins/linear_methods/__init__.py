"""The bundled linear methods (interfaces.model.LinearMethod), one file each:

- cpu_bf16: bf16 on CPU, every weight packed for the kernel its measured plan gives each
  row count (cpu_gemm.cpp, on AMX tiles where the CPU has them; oneDNN; ATen), with
  exponent-coded copies for one-row steps as an option; what bf16 on a CPU runs unless
  `stack.linear_method` names another.
- int8: int8 weight-only quantization for AVX-512 CPUs.

Registered by "module:Class" reference: the API-server process loads this module with
every plugin, and must not import the worker code the methods are written against.
"""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_linear_methods(register):
    register("cpu_bf16", "plugserve_plugins.linear_methods.cpu_bf16:PackedCpuBf16")
    register("int8", "plugserve_plugins.linear_methods.int8_weight_only:Int8WeightOnly")
