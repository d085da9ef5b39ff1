"""The capability Protocols of plugserve.capabilities: what a part offers beyond its slot,
asked with supports_x / has_x instead of getattr probes."""

from __future__ import annotations

from plugserve import capabilities
from plugserve.worker.models.bert import BertModel
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve_plugins.executors.mp import MultiprocExecutor
from plugserve_plugins.executors.uni import UniProcExecutor
from plugserve_plugins.kernels.flashinfer import FlashInferAttention
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention


class _GraphBackend:
    def init_cuda_graphs(self, sizes, max_blocks_per_req): ...

    def prepare_graph(self, batch, padded_size): ...


def test_a_capability_needs_every_method_it_names() -> None:
    assert capabilities.supports_cuda_graphs(_GraphBackend())

    class Blocked(_GraphBackend):
        prepare_graph = None  # a method set to None is not offered

    assert not capabilities.supports_cuda_graphs(Blocked())

    class InitOnly:
        def init_cuda_graphs(self, sizes, max_blocks_per_req): ...

    assert not capabilities.supports_cuda_graphs(InitOnly())
    assert not capabilities.supports_cuda_graphs(object())


def test_the_bundled_attention_backends_declare_what_they_offer() -> None:
    assert capabilities.reports_unavailability(FlashInferAttention)
    assert capabilities.has_dtypes(FlashInferAttention)
    assert FlashInferAttention.dtypes == ("bfloat16", "float16")
    assert capabilities.supports_cuda_graphs(FlashInferAttention)
    assert not capabilities.supports_fused_cpu_layer(FlashInferAttention)

    assert capabilities.supports_fused_cpu_layer(TorchPagedAttention)
    assert not capabilities.supports_cuda_graphs(TorchPagedAttention)
    assert not capabilities.has_dtypes(TorchPagedAttention)
    assert not capabilities.reports_unavailability(TorchPagedAttention)


def test_the_bundled_executors_and_model_declare_what_they_offer() -> None:
    assert capabilities.has_tensor_parallel_limit(UniProcExecutor)
    assert UniProcExecutor.max_tensor_parallel_size == 1
    assert capabilities.supports_weight_read_probe(UniProcExecutor)
    assert not capabilities.has_tensor_parallel_limit(MultiprocExecutor)
    assert not capabilities.supports_weight_read_probe(MultiprocExecutor)
    assert capabilities.counts_messages(MultiprocExecutor)
    assert not capabilities.counts_messages(UniProcExecutor)  # it has no messages to count

    assert capabilities.supports_weight_buffer(LlamaForCausalLM)
    # Decoders pool without their LM head; an encoder has none to drop.
    assert capabilities.builds_without_lm_head(LlamaForCausalLM)
    assert not capabilities.builds_without_lm_head(BertModel)
