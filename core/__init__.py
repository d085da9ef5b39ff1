"""plugserve: a pluggable LLM inference server.

`from plugserve import LLM, SamplingParams` for offline generation; `hookimpl` marks the
functions of a plugin module (see plugserve.hookspecs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from plugserve.sampling_params import SamplingParams

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("plugserve")

if TYPE_CHECKING:
    from plugserve.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # The offline API pulls in torch and the engine; keep `import plugserve` light for
    # plugin modules that only need `hookimpl`.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from plugserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'plugserve' has no attribute {name!r}")
