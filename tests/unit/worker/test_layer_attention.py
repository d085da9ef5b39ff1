"""Per-layer attention options (interfaces.model.LayerAttention) from the model class to the
backend: the model runner asks the model class, and refuses a backend that would ignore
an option the layers need."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plugserve.capabilities import has_layer_attention
from plugserve.interfaces.model import FULL_ATTENTION, LayerAttention
from plugserve.worker.model_runner import attention_layers, check_layer_attention
from plugserve.worker.models.decoder import DecoderForCausalLM
from plugserve.worker.models.llama import LlamaForCausalLM
from plugserve_plugins.kernels.torch_paged import TorchPagedAttention

WINDOWED = LayerAttention(sliding_window=16)


class PlainBackend:
    """A backend that declares no per-layer options (as every one did before them)."""


class WindowOnlyBackend:
    layer_attention_options = frozenset({"sliding_window"})


class AlternatingWindows(DecoderForCausalLM):
    @classmethod
    def attention_layers(cls, hf_config: object) -> list[LayerAttention]:
        return [WINDOWED if i % 2 == 0 else FULL_ATTENTION for i in range(4)]


def test_decoder_models_default_to_full_attention_everywhere() -> None:
    config = SimpleNamespace(num_hidden_layers=3, sliding_window=4096)  # as Qwen2's carry
    assert has_layer_attention(LlamaForCausalLM)
    assert LlamaForCausalLM.attention_layers(config) == [FULL_ATTENTION] * 3
    # All full is said as the empty tuple: the spec every existing backend was built with.
    assert attention_layers(LlamaForCausalLM, config) == ()
    assert attention_layers(object, config) == ()


def test_the_model_class_says_which_layers_slide() -> None:
    layers = attention_layers(AlternatingWindows, SimpleNamespace(num_hidden_layers=4))
    assert layers == (WINDOWED, FULL_ATTENTION, WINDOWED, FULL_ATTENTION)


def test_a_backend_that_would_ignore_an_option_is_refused() -> None:
    layers = (LayerAttention(sliding_window=8, logit_softcap=50.0), FULL_ATTENTION)
    with pytest.raises(ValueError, match="attention 'plain' does not support logit_softcap, "):
        check_layer_attention(PlainBackend, "plain", layers)
    with pytest.raises(ValueError, match="does not support logit_softcap,"):
        check_layer_attention(WindowOnlyBackend, "windows", layers)
    check_layer_attention(WindowOnlyBackend, "windows", (WINDOWED,))
    check_layer_attention(TorchPagedAttention, "torch", layers)
    check_layer_attention(PlainBackend, "plain", ())  # full attention needs nothing
