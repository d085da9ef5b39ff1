"""PooledTensor: a pooled output as raw bytes, from the worker to the API server."""

from __future__ import annotations

import msgspec
import numpy as np


class PooledTensor(msgspec.Struct, array_like=True):
    """One request's pooled output: the array's bytes in native order, its numpy dtype
    name and shape. Raw bytes cross the transport in one copy each way, where a list of
    floats would be encoded and decoded number by number."""

    data: bytes
    dtype: str
    shape: list[int]

    @classmethod
    def from_array(cls, array: np.ndarray) -> PooledTensor:
        array = np.ascontiguousarray(array)
        return cls(array.tobytes(), array.dtype.str, list(array.shape))

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
