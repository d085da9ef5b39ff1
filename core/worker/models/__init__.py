"""Model architectures that ship with the core, registered like any plugin's."""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_models(register):
    from plugserve.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

    register("LlamaForCausalLM", LlamaForCausalLM)
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
