"""The bundled linear methods (interfaces.model.LinearMethod) other than the bf16 CPU fast
path's (plugserve_plugins.cpu_bf16), one file each:

- int8: int8 weights with int8 activations quantized per token (W8A8), for AVX512-VNNI
  CPUs (int8_w8a8.py);
- int8_weight_only: int8 weights, bf16 activations, for AVX-512 CPUs (int8_weight_only.py);
- cpu_fp32: fp32 weights reordered once for oneDNN's matmul, or packed once for FMA register
  tiles (cpu_fp32_gemm.cpp), or kept for F.linear, whichever times fastest (cpu_fp32.py).

Registered by "module:Class" reference: the API-server process loads this module with
every plugin, and must not import the worker code the methods are written against.
"""

from __future__ import annotations

from plugserve import hookimpl
from plugserve.hookspecs import Register


@hookimpl
def register_linear_methods(register: Register) -> None:
    register("int8", "plugserve_plugins.linear_methods.int8_w8a8:Int8W8A8")
    register("int8_weight_only", "plugserve_plugins.linear_methods.int8_weight_only:Int8WeightOnly")
    register("cpu_fp32", "plugserve_plugins.linear_methods.cpu_fp32:CpuFp32LinearMethod")
