"""Model architectures that ship with the core, registered like any plugin's."""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_models(register):
    from plugserve.worker.models.llama import LlamaForCausalLM

    register("LlamaForCausalLM", LlamaForCausalLM)
    # Qwen2 is Llama with biases on q/k/v; the same class reads it from the config.
    register("Qwen2ForCausalLM", LlamaForCausalLM)
