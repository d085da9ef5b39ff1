"""What the scheduler must know of a pooling engine: which prompts run whole, and which
may start from prefix-cached blocks."""

from __future__ import annotations

from dataclasses import dataclass

from plugserve.datatypes import Request


@dataclass(frozen=True)
class PoolingScheduling:
    # Bidirectional attention (an encoder): every token of a prompt attends to every
    # other, so a prompt runs in one step and never continues a cached prefix.
    whole_prompts: bool
    # The pooler reads every prompt token's hidden state, which a cached prefix skips.
    reads_every_token: bool

    def may_use_prefix_cache(self, request: Request) -> bool:
        """Whether `request` may start from cached blocks: only where the pooled output
        reads no hidden state of the prefix (last-token pooling on a decoder)."""
        params = request.pooling_params
        if params is None:
            return True
        return not (self.whole_prompts or self.reads_every_token or params.task == "token_embed")

    def fits(self, request: Request, num_new: int) -> bool:
        """Whether `num_new` tokens this step are enough for `request` to be admitted."""
        return not self.whole_prompts or num_new >= request.num_tokens
