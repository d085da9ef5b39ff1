"""What a model asks of the attention backend before it is built: what its layers
compute (interfaces.model.LayerAttention), with the refusal of a backend that would
ignore it, and the longest context its positions allow."""

from __future__ import annotations

from typing import Any

from plugserve.capabilities import (
    has_context_limit,
    has_layer_attention,
    honours_layer_attention,
)
from plugserve.interfaces.model import LayerAttention
from plugserve.pooling_setup import PoolingSetup


def attention_layers(model_cls: type, hf_config: Any) -> tuple[LayerAttention, ...]:
    """What each layer's attention computes, as the model class says (empty: all full)."""
    if not has_layer_attention(model_cls):
        return ()
    layers = tuple(model_cls.attention_layers(hf_config))
    return () if all(layer.is_full for layer in layers) else layers


def check_layer_attention(backend_cls: type, name: str, layers: tuple[LayerAttention, ...]) -> None:
    """Refuse a backend that would ignore an option the model's layers need."""
    needed = {
        option
        for layer in layers
        for option in ("sliding_window", "logit_softcap", "scale", "bidirectional")
        if getattr(layer, option) not in (None, False)
    }
    honoured = backend_cls.layer_attention_options if honours_layer_attention(backend_cls) else ()
    missing = sorted(needed - set(honoured))
    if missing:
        raise ValueError(
            f"attention {name!r} does not support {', '.join(missing)}, which this model's "
            "layers need"
        )


def context_limit(model_cls: type, hf_config: Any, setup: PoolingSetup) -> int:
    """The longest context the model's position ids allow, and for a pooling model no
    more than the prompt length its sentence-transformers config was trained for."""
    limit = (
        model_cls.context_limit(hf_config)
        if has_context_limit(model_cls)
        else getattr(hf_config, "max_position_embeddings", None) or 2048
    )
    if setup.is_pooling and setup.max_seq_length:
        limit = min(limit, setup.max_seq_length)
    return limit
