"""The capability Protocols of plugserve.interfaces: what a part offers beyond its slot,
asked with supports_x / has_x instead of getattr probes."""

from __future__ import annotations

from plugserve import interfaces
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve_plugins.executors.mp import MultiprocExecutor
from plugserve_plugins.executors.uni import UniProcExecutor
from plugserve_plugins.kernels.flashinfer import FlashInferAttention
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention


class _GraphBackend:
    def init_cuda_graphs(self, sizes, max_blocks_per_req): ...

    def prepare_graph(self, batch, padded_size): ...


def test_a_capability_needs_every_method_it_names() -> None:
    assert interfaces.supports_cuda_graphs(_GraphBackend())

    class Blocked(_GraphBackend):
        prepare_graph = None  # a method set to None is not offered

    assert not interfaces.supports_cuda_graphs(Blocked())

    class InitOnly:
        def init_cuda_graphs(self, sizes, max_blocks_per_req): ...

    assert not interfaces.supports_cuda_graphs(InitOnly())
    assert not interfaces.supports_cuda_graphs(object())


def test_the_bundled_attention_backends_declare_what_they_offer() -> None:
    assert interfaces.reports_unavailability(FlashInferAttention)
    assert interfaces.has_dtypes(FlashInferAttention)
    assert FlashInferAttention.dtypes == ("bfloat16", "float16")
    assert interfaces.supports_cuda_graphs(FlashInferAttention)
    assert not interfaces.supports_fused_cpu_layer(FlashInferAttention)

    assert interfaces.supports_fused_cpu_layer(TorchPagedAttention)
    assert not interfaces.supports_cuda_graphs(TorchPagedAttention)
    assert not interfaces.has_dtypes(TorchPagedAttention)
    assert not interfaces.reports_unavailability(TorchPagedAttention)


def test_the_bundled_executors_and_model_declare_what_they_offer() -> None:
    assert interfaces.has_tensor_parallel_limit(UniProcExecutor)
    assert UniProcExecutor.max_tensor_parallel_size == 1
    assert interfaces.supports_weight_read_probe(UniProcExecutor)
    assert not interfaces.has_tensor_parallel_limit(MultiprocExecutor)
    assert not interfaces.supports_weight_read_probe(MultiprocExecutor)

    assert interfaces.supports_weight_post_processing(LlamaForCausalLM)
    assert interfaces.supports_weight_buffer(LlamaForCausalLM)
