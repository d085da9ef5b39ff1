"""GrammarOutput: the batch's allowed tokens, from the engine to the executor (phase 8)."""

from __future__ import annotations

import msgspec
import numpy as np


class GrammarOutput(msgspec.Struct, kw_only=True):
    """Built by the engine on the CPU while the forward pass runs, applied by the model
    runner to the parked logits before sampling.

    `bitmask` is int32 [len(req_ids), ceil(vocab_size / 32)] in native byte order, one row
    per entry of `req_ids`: bit j of word i set means token 32 * i + j may be sampled
    (xgrammar's and llguidance's layout). A constrained request has one entry, or, when
    it verifies draft tokens (speculative decoding), one per position it samples at, in
    order. Rows of requests without a grammar are not in it and are left untouched.
    """

    req_ids: list[str]
    bitmask: bytes

    def bitmask_array(self) -> np.ndarray:
        words = np.frombuffer(self.bitmask, dtype=np.int32)
        return words.reshape(len(self.req_ids), -1) if self.req_ids else words.reshape(0, 0)
