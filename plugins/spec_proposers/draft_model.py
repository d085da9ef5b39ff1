"""`draft_model`: a second, smaller model of the served model's vocabulary guesses the
next tokens, greedily, one pass per token.

It proposes in the model runner (capabilities.ProposesInWorker): the runner loads the
draft beside the served model, on every tensor-parallel rank, with a KV cache of its own
that follows each request's (proposer_model.py in the core says how), and asks for the
next drafts right after each step's sampling. For each request that sampled, the draft
reads the new token and writes its argmax, then reads that and writes the next, up to
`num_tokens`; all requests run together, one batched pass per guessed position.

    stack:
      speculative: {proposer: draft_model, num_tokens: 3}
    plugins:
      draft_model: {model: /models/SmolLM2-135M-Instruct}

A draft as good as the target (the model itself) has every guess accepted; a draft that
often disagrees costs its passes and lands little. The greedy output is the target's
either way: the rejection sampler keeps only what the target would have written.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from plugserve import hookimpl
from plugserve.interfaces.speculative import ProposerModel, WorkerDraftRequests


class DraftModelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The draft: a built-in name, a Hugging Face folder or a GGUF file, with the served
    # model's vocabulary (the default is the embedded SmolLM2-135M-Instruct).
    model: str = "smollm2-135m-instruct"


class DraftModelProposer:
    Options = DraftModelOptions

    def __init__(
        self, *, num_tokens: int, vocab_size: int, options: DraftModelOptions | None = None
    ) -> None:
        self.num_tokens = num_tokens
        self.options = options or DraftModelOptions()

    def proposer_model(self) -> str:
        return self.options.model

    def propose_in_worker(
        self, model: ProposerModel, requests: WorkerDraftRequests
    ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests.req_ids]
        limits = np.minimum(requests.max_num_tokens, self.num_tokens)
        active = np.flatnonzero(limits > 0)
        tokens = requests.token_ids[active]
        positions = requests.positions[active]
        for guessed in range(int(limits.max(initial=0))):
            logits = model.decode([requests.req_ids[i] for i in active], tokens, positions)
            chosen = (
                logits.argmax(dim=-1).cpu().numpy()
                if logits is not None
                else np.zeros(len(active), dtype=np.int64)
            )
            chosen = model.share(chosen.astype(np.int64))
            for index, token in zip(active.tolist(), chosen.tolist(), strict=True):
                drafts[index].append(token)
            going_on = limits[active] > guessed + 1
            active, tokens, positions = active[going_on], chosen[going_on], positions[going_on] + 1
            if not len(active):
                break
        return drafts


@hookimpl
def register_spec_proposers(register):
    register("draft_model", DraftModelProposer)
