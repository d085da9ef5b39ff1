"""The example third-party pooler (tests/plugins/plugserve-max-pooler, installed by the
Makefile like any package) is found through its own entry point and distribution, and
builds as the pooler slot's Protocol says; the plugin matrix serves it
(tests/matrix/test_matrix.py, test_pooler_cell_matches_hf[max]: /v1/embeddings equal to
transformers' hidden states max-pooled and normalised)."""

from __future__ import annotations

import torch

from plugserve.interfaces.pooling import Pooler
from plugserve.plugins import get_registry


def test_registered_from_its_own_distribution():
    implementations = get_registry().implementations("pooler")
    assert implementations["max"].distribution == "plugserve-max-pooler"
    assert implementations["max"].plugin == "max_pooler"


def test_pools_the_element_wise_maximum_in_fp32():
    pooler = get_registry().build("pooler", "max")
    assert isinstance(pooler, Pooler) and pooler.tokens == "all"
    hidden = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.0]], dtype=torch.bfloat16)
    pooled = pooler.pool(hidden)
    assert pooled.dtype == torch.float32
    torch.testing.assert_close(pooled, torch.tensor([1.0, 3.0]))
