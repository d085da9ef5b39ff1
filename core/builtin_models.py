"""The model architectures that ship with the core, registered like any plugin's.

By "module:Class" reference: the registry imports a model's module only when an engine
builds it, so the API-server process, which loads the registry for its own slots, never
imports model code.
"""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", "plugserve.worker.models.llama:LlamaForCausalLM")
    register("Qwen2ForCausalLM", "plugserve.worker.models.llama:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "plugserve.worker.models.qwen3:Qwen3ForCausalLM")
    # Base models (no head: Qwen3-Embedding's layout), served for pooling by the same frame.
    register("Qwen2Model", "plugserve.worker.models.llama:Qwen2ForCausalLM")
    register("Qwen3Model", "plugserve.worker.models.qwen3:Qwen3ForCausalLM")
    register("Gemma2ForCausalLM", "plugserve.worker.models.gemma:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", "plugserve.worker.models.gemma:Gemma3ForCausalLM")
    register("MistralForCausalLM", "plugserve.worker.models.mistral:MistralForCausalLM")
    register("Phi3ForCausalLM", "plugserve.worker.models.phi3:Phi3ForCausalLM")
    register("Qwen3MoeForCausalLM", "plugserve.worker.models.qwen3_moe:Qwen3MoeForCausalLM")
    register("MixtralForCausalLM", "plugserve.worker.models.mixtral:MixtralForCausalLM")
    # Encoders, served for pooling only (embeddings, classification, scores).
    register("BertModel", "plugserve.worker.models.bert:BertModel")
    register(
        "BertForSequenceClassification",
        "plugserve.worker.models.bert:BertForSequenceClassification",
    )
    register("XLMRobertaModel", "plugserve.worker.models.xlm_roberta:XLMRobertaModel")
    register(
        "XLMRobertaForSequenceClassification",
        "plugserve.worker.models.xlm_roberta:XLMRobertaForSequenceClassification",
    )
