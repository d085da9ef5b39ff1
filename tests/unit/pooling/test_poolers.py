"""The bundled poolers, and the core's finish of a pooled output (PooledOutputs): the
classification head's activation, Matryoshka truncation then normalisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugserve.datatypes import PooledTensor
from plugserve.interfaces.pooling import Pooler
from plugserve.plugins import get_registry
from plugserve.pooling_params import PoolingParams
from plugserve.pooling_setup import PoolingSetup
from plugserve.worker.pooled_outputs import PooledOutputs

HIDDEN = torch.arange(12, dtype=torch.float32).reshape(3, 4)  # 3 tokens, hidden size 4


@pytest.mark.parametrize(
    ("name", "reads", "expected"),
    [
        ("last", "last", HIDDEN[2]),
        ("cls", "first", HIDDEN[0]),
        ("mean", "all", HIDDEN.mean(dim=0)),
        ("all", "all", HIDDEN),
    ],
)
def test_bundled_poolers(name, reads, expected):
    pooler = get_registry().build("pooler", name)
    assert isinstance(pooler, Pooler)
    assert pooler.tokens == reads
    rows = {"first": HIDDEN[:1], "last": HIDDEN[-1:], "all": HIDDEN}[reads]
    torch.testing.assert_close(pooler.pool(rows), expected)


def test_mean_pools_bf16_in_fp32():
    pooler = get_registry().build("pooler", "mean")
    rows = torch.full((3, 2), 1.0 + 2**-8, dtype=torch.bfloat16)  # rounds in bf16 sums
    assert pooler.pool(rows).dtype == torch.float32


class TwoLabelHead(torch.nn.Module):
    def __init__(self, labels: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(labels, 4))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return (pooled @ self.weight.T * torch.arange(1, self.weight.shape[0] + 1)).float()


def finish(model, params: PoolingParams, vector: torch.Tensor, normalize: bool = True):
    setup = PoolingSetup(runner="pooling", architecture="X", pooler="cls", normalize=normalize)
    outputs = PooledOutputs(model, get_registry().build("pooler", "cls"), setup)
    outputs._params["r"] = params
    with torch.inference_mode():  # as the model runner calls it
        (pooled,) = outputs._finish([("r", vector)]).values()
    assert isinstance(pooled, PooledTensor)
    return pooled.to_array()


def test_embedding_is_cut_to_dimensions_then_normalised():
    vector = torch.tensor([3.0, 4.0, 12.0, 1.0])
    got = finish(torch.nn.Linear(1, 1), PoolingParams(dimensions=2), vector)
    np.testing.assert_allclose(got, [0.6, 0.8])
    raw = finish(torch.nn.Linear(1, 1), PoolingParams(normalize=False), vector)
    np.testing.assert_allclose(raw, vector.numpy())
    # The checkpoint's setting holds where the request says nothing.
    unnormalised = finish(torch.nn.Linear(1, 1), PoolingParams(), vector, normalize=False)
    np.testing.assert_allclose(unnormalised, vector.numpy())


def test_classifier_softmax_over_labels_and_sigmoid_for_one():
    x = torch.tensor([0.5, 0.0, 0.0, 0.0])
    probs = finish(TwoLabelHead(2), PoolingParams(task="classify"), x)
    np.testing.assert_allclose(probs, torch.tensor([0.5, 1.0]).softmax(0).numpy(), rtol=1e-6)
    score = finish(TwoLabelHead(1), PoolingParams(task="score"), x)
    np.testing.assert_allclose(score, [torch.tensor(0.5).sigmoid().item()], rtol=1e-6)
    logits = finish(TwoLabelHead(2), PoolingParams(task="classify", activation=False), x)
    np.testing.assert_allclose(logits, [0.5, 1.0])


def test_pooled_tensor_round_trips_as_raw_bytes():
    import msgspec

    array = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    tensor = PooledTensor.from_array(array)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(tensor), type=PooledTensor)
    assert isinstance(decoded.data, bytes) and len(decoded.data) == array.nbytes
    np.testing.assert_array_equal(decoded.to_array(), array)
