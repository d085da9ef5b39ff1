"""Phase 8: turn the logits of the rows that sample this step into tokens and logprobs.

Everything is vectorized over the batch and runs on whatever device the logits live on.
The only per-row Python loop on the hot path is over rows that carry their own seed: each
draws its noise from its own `torch.Generator`, so a seeded request yields the same tokens
whatever else shares its batch.

Order of operations (as in vLLM and the OpenAI API):

0. (the model runner, before the sampler) the grammar bitmask of constrained rows:
   `apply_grammar_bitmask`;
1. logprobs of the raw logits (before penalties and temperature), when any row asked;
2. allowed_token_ids, bad words, logit_bias;
3. repetition, frequency and presence penalties;
4. greedy rows: argmax of the penalized logits;
5. random rows: temperature, min_p, top_k, top_p, then an exponential race.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from plugserve.datatypes import Logprobs
from plugserve.sampling_params import _GREEDY_EPS
from plugserve.worker import cpu_ops

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "TokenEdits",
    "apply_grammar_bitmask",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "exponential_race",
    "gather_logprobs",
    "make_padded_token_tensor",
    "random_probs",
    "token_logprobs",
    "uniform_noise",
]


@dataclass
class TokenEdits:
    """Per-(row, token) edits of the logits: `values[i]` is added at
    (`rows[i]`, `token_ids[i]`) (int64, int64, float32 [N] each); -inf bans the token."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    values: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per-step, per-row sampling inputs, built by `InputBatch.sampling_metadata`.

    Rows are the requests that sample this step, in the order of the logits. Every tensor
    lives on the logits' device; a generator must be of that device too. Optional fields
    are None when no row uses the feature, which lets the sampler skip it without looking
    at the tensors (no host sync).
    """

    temperature: torch.Tensor  # float32 [B]; below 1e-5 means greedy for that row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [B], 0 = disabled
    # The largest enabled k (1 when none is): known on the host, so top-k needs no
    # device-to-host read to size its topk.
    max_top_k: int | None = None
    top_p: torch.Tensor | None = None  # float32 [B], 1.0 = disabled
    min_p: torch.Tensor | None = None  # float32 [B], 0 = disabled
    # Row index -> that request's generator (seeded rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    presence_penalties: torch.Tensor | None = None  # float32 [B], 0 = disabled
    frequency_penalties: torch.Tensor | None = None  # float32 [B], 0 = disabled
    repetition_penalties: torch.Tensor | None = None  # float32 [B], 1.0 = disabled
    # Padded with vocab_size (== logits.shape[-1]); the prompt is only read by the
    # repetition penalty, the output by all three penalties.
    prompt_token_ids: torch.Tensor | None = None  # int64 [B, max_prompt_len]
    output_token_ids: torch.Tensor | None = None  # int64 [B, max_output_len]
    # None: no row asked for logprobs; else the largest top-N over rows (0: only the
    # sampled token's logprob).
    max_num_logprobs: int | None = None
    # allowed_token_ids: True where a row may not sample the token; rows without the
    # option are all False. bool [B, V].
    disallowed: torch.Tensor | None = None
    # Bad words: the tokens that would complete a banned sequence now (rows that have
    # some), set to -inf. Depends on the output so far: rebuilt every step.
    bad_words: TokenEdits | None = None
    # logit_bias: OpenAI's token id -> bias, added.
    logit_bias: TokenEdits | None = None

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalties is not None
            or self.frequency_penalties is not None
            or self.repetition_penalties is not None
        )

    @property
    def edits_logits(self) -> bool:
        """allowed_token_ids, bad words or logit_bias change some row's logits."""
        return (
            self.disallowed is not None or self.bad_words is not None or self.logit_bias is not None
        )

    @property
    def reads_output(self) -> bool:
        """Built from the tokens so far (penalties, bad words): valid for one step only."""
        return self.uses_penalties or self.bad_words is not None


@dataclass
class LogprobsTensors:
    """Logprobs of every sampling row, computed from the raw logits.

    Rows that asked for fewer than N alternatives (or none) simply use a prefix, or
    nothing, of their row; see `to_logprobs`.
    """

    top_token_ids: torch.Tensor  # int64 [B, N], most likely first
    top_logprobs: torch.Tensor  # float32 [B, N]
    sampled_logprobs: torch.Tensor  # float32 [B]
    sampled_ranks: torch.Tensor  # int64 [B], 1 = the most likely token

    def to_logprobs(self, num_logprobs: Sequence[int | None]) -> list[Logprobs | None]:
        """One Logprobs per row (None where the row asked for none), trimmed to its top-N.

        Each tensor crosses to the host once for the whole batch.
        """
        top_ids = self.top_token_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        sampled_lps = self.sampled_logprobs.tolist()
        ranks = self.sampled_ranks.tolist()
        result: list[Logprobs | None] = []
        for row, n in enumerate(num_logprobs):
            if n is None:
                result.append(None)
                continue
            result.append(
                Logprobs(
                    sampled_logprob=sampled_lps[row],
                    sampled_rank=ranks[row],
                    top_token_ids=top_ids[row][:n],
                    top_logprobs=top_lps[row][:n],
                )
            )
        return result


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: LogprobsTensors | None


class Sampler:
    """Stateless; one instance serves every step."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab_size], got {tuple(logits.shape)}")
        num_logprobs = metadata.max_num_logprobs
        raw_logprobs = None
        if num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)

        if metadata.all_greedy and not metadata.uses_penalties and not metadata.edits_logits:
            # Nothing edits the logits, so skip the working copy.
            sampled = cpu_ops.argmax(logits)
        else:
            # One float32 working copy: the caller's logits stay untouched and every
            # later stage may edit this one in place.
            work = logits.to(dtype=torch.float32, copy=True)
            work = apply_token_edits(work, metadata)
            work = apply_penalties(work, metadata)
            sampled = _sample(work, metadata)

        logprobs = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    # Greedy ids must be taken before temperature and the filters edit `logits`.
    greedy = None if metadata.all_random else cpu_ops.argmax(logits)
    if metadata.all_greedy:
        assert greedy is not None
        return greedy
    sampled = _sample_random(logits, metadata)
    if greedy is None:
        return sampled
    return torch.where(metadata.temperature < _GREEDY_EPS, greedy, sampled)


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    return exponential_race(random_probs(logits, metadata), metadata.generators)


def random_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from: temperature, min_p, top_k and top_p
    applied to float32 `logits` (edited in place), then softmax. Greedy rows come out as
    if at temperature 1 (callers take their argmax instead)."""
    temperature = metadata.temperature
    if metadata.all_random:
        # The flags come from the caller; should one mislabel a near-zero temperature,
        # the clamp keeps the division finite and the row samples as if nearly greedy.
        temperature = temperature.clamp_min(_GREEDY_EPS)
    else:
        # Greedy rows ride through the random path (torch.where discards them later); a
        # unit temperature keeps their division finite.
        temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
    logits.div_(temperature.unsqueeze(1))
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    return logits.softmax(dim=-1)


def apply_grammar_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: np.ndarray) -> None:
    """In place: in logits row `rows[i]`, -inf for every token that row i of the int32
    bitmask (bit j of word w = token 32 * w + j; datatypes.GrammarOutput) does not allow.
    Other rows are not touched; tokens past the bitmask's width are never allowed."""
    if not len(rows):
        return
    vocab_size = logits.shape[-1]
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    if logits.device.type == "cpu" and sys.byteorder == "little":
        # A little-endian word's bytes, each unpacked low bit first, are its tokens in
        # order: one pass, where shifting every word by 0..31 made 32 copies of the mask.
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        disallowed = torch.from_numpy(bits[:, :vocab_size] == 0)
    else:
        device_words = torch.from_numpy(words).to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((device_words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
        disallowed = ~allowed[:, :vocab_size]
    if disallowed.shape[1] < vocab_size:
        disallowed = torch.nn.functional.pad(
            disallowed, (0, vocab_size - disallowed.shape[1]), value=True
        )
    if list(rows) == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = torch.as_tensor(list(rows), dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))


def apply_token_edits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, then bad words, then logit_bias, on float32 `logits` in place;
    rows without them keep their values exactly."""
    if metadata.disallowed is not None:
        logits.masked_fill_(metadata.disallowed, float("-inf"))
    for edits in (metadata.bad_words, metadata.logit_bias):
        if edits is not None:
            logits.index_put_((edits.rows, edits.token_ids), edits.values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on float32 `logits`.

    Repetition applies to every token seen in the prompt or the output (positive logits
    are divided by the penalty, the others multiplied); frequency subtracts
    penalty × count in the output, presence subtracts penalty once per token seen in the
    output. May edit `logits` in place; use the returned tensor.
    """
    if not metadata.uses_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = None
    if metadata.output_token_ids is not None:
        output_counts = _token_counts(metadata.output_token_ids, num_rows, vocab_size, logits)

    if metadata.repetition_penalties is not None:
        seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        if metadata.prompt_token_ids is not None:
            seen.scatter_(1, metadata.prompt_token_ids, True)
        seen = seen[:, :vocab_size]
        if output_counts is not None:
            seen |= output_counts > 0
        penalty = metadata.repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)

    if output_counts is not None:
        if metadata.frequency_penalties is not None:
            logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
        if metadata.presence_penalties is not None:
            logits -= metadata.presence_penalties.unsqueeze(1) * (output_counts > 0)
    return logits


def _token_counts(
    token_ids: torch.Tensor, num_rows: int, vocab_size: int, like: torch.Tensor
) -> torch.Tensor:
    """[B, V] counts of each token id per row; the pad id vocab_size lands in a column
    that is sliced off. Counts are float32 (exact below 2**24) so they multiply straight
    into the logits."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=like.dtype, device=like.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=like.dtype))
    return counts[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p × the top probability, in place.

    Compared in log space, p_i < min_p × p_max ⟺ logit_i < logit_max + log(min_p), which
    needs no softmax; min_p = 0 gives log 0 = -inf and drops nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Keep each row's k most likely tokens, then its nucleus of mass top_p.

    Ties with the k-th logit are all kept. The nucleus is the smallest set of most likely
    tokens whose probability (renormalized after top-k) sums to at least top_p; the top
    token always stays. May edit `logits` in place; use the returned tensor.
    `max_top_k`: the largest enabled k, when the caller knows it (else read from `top_k`,
    a device-to-host sync).
    """
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k, max_top_k)

    vocab_size = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        disabled = (top_k <= 0) | (top_k >= vocab_size)
        k = top_k.masked_fill(disabled, vocab_size)
        # Ascending order: the k-th largest sits at index V - k (index 0 when disabled,
        # the smallest value, which masks nothing).
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))

    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    # A token goes when the mass of all tokens less likely than or as likely as it is
    # within 1 - top_p, i.e. the more likely ones alone already reach top_p. The last
    # (most likely) token always stays, which also absorbs rounding in the cumsum.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def _apply_top_k_only(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None
) -> torch.Tensor:
    # topk over the largest k in use is much cheaper than a full sort of the vocab.
    vocab_size = logits.shape[-1]
    disabled = (top_k <= 0) | (top_k >= vocab_size)
    # Disabled rows borrow k = 1 so they don't inflate max_k; their threshold is reset
    # to -inf below.
    k = top_k.masked_fill(disabled, 1)
    max_k = max_top_k if max_top_k is not None else int(k.max().item())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def uniform_noise(like: torch.Tensor, generators: Mapping[int, torch.Generator]) -> torch.Tensor:
    """Uniform [0, 1) noise shaped like `like`; a seeded row's from its own generator."""
    u = torch.empty_like(like)
    if len(generators) < like.shape[0]:
        u.uniform_()
    # A seeded row's noise depends only on its own generator, so its tokens don't depend
    # on the batch around it.
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    return u


def exponential_race(
    probs: torch.Tensor, generators: Mapping[int, torch.Generator]
) -> torch.Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exponential(1) picks token i with
    probability p_i, with no cumsum or multinomial (and no host sync). q is -log(u) with u
    uniform: torch's CPU exponential_ is several times slower than uniform_ and log_ over a
    vocabulary-wide row (docs/benchmarks-history.md, "Figures from code comments")."""
    q = uniform_noise(probs, generators)
    return probs.div_(q.log_().neg_()).argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of given tokens (prompt logprobs: each prompt token given those before
    it) from raw logits, with each row's rank and top-N, as for sampled tokens."""
    return gather_logprobs(logits.log_softmax(dim=-1, dtype=torch.float32), token_ids, num_logprobs)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_token_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
        sampled_logprobs=sampled_logprobs.squeeze(1),
        sampled_ranks=ranks,
    )


def make_padded_token_tensor(
    rows: Sequence[Sequence[int] | np.ndarray],
    pad: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 [len(rows), longest row] of token ids, right-padded with `pad`.

    Filled through one preallocated numpy array and moved to the device in a single
    copy. Pass pad = vocab_size for the sampler's penalty inputs.
    """
    max_len = max((len(row) for row in rows), default=0)
    out = np.full((len(rows), max_len), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out).to(device)
