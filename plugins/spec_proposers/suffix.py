"""`suffix`: suffix decoding. Every position of a request's prompt and output is indexed
by the tokens that end there (every suffix up to `max_depth` tokens long); optionally
earlier requests' prompts and outputs too (the last `cache_requests` to finish), which is
where agentic and repetitive workloads repeat themselves across requests.

To propose, the longest suffix of the request's tokens that occurred before is found;
the positions where it occurred vote on the next token. The most common next token is
proposed with its share of the votes as confidence; the walk goes on among the positions
that agreed, and stops when the product of the confidences falls below `min_confidence`
(or the proposal reaches its limit). A long, unanimous match gives a long draft, a
short or contested one a short draft or none: the number of tokens follows the
evidence, where `ngram` always proposes all it may.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from plugserve import hookimpl
from plugserve.interfaces.speculative import DraftRequest


class SuffixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_depth: int = Field(8, ge=1)  # the longest suffix indexed and matched
    min_confidence: float = Field(0.3, gt=0, le=1)  # stop the draft below this
    # Finished requests kept to match against (prompt and output); 0: each request
    # looks only at itself.
    cache_requests: int = Field(64, ge=0)


# A position in some token sequence: (sequence key, index of the token that ends the match).
Position = tuple[int, int]


class SuffixIndex:
    """Positions of every suffix (up to `max_depth` tokens) ending at each index of the
    sequences added, extended as they grow."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.sequences: dict[int, list[int]] = {}
        self.indexed: dict[int, int] = {}  # how many tokens of each sequence are indexed
        self.positions: defaultdict[tuple[int, ...], list[Position]] = defaultdict(list)

    def extend(self, key: int, tokens: Sequence[int]) -> None:
        """Index `tokens` (the whole sequence so far) past what was indexed of `key`."""
        sequence = self.sequences.setdefault(key, [])
        sequence.extend(tokens[len(sequence) :])
        start = self.indexed.get(key, 0)
        for end in range(start, len(sequence)):
            for n in range(1, min(self.max_depth, end + 1) + 1):
                self.positions[tuple(sequence[end - n + 1 : end + 1])].append((key, end))
        self.indexed[key] = len(sequence)

    def remove(self, key: int) -> None:
        sequence = self.sequences.pop(key, None)
        self.indexed.pop(key, None)
        if sequence is None:
            return
        for end in range(len(sequence)):
            for n in range(1, min(self.max_depth, end + 1) + 1):
                suffix = tuple(sequence[end - n + 1 : end + 1])
                kept = [p for p in self.positions[suffix] if p[0] != key]
                if kept:
                    self.positions[suffix] = kept
                else:
                    del self.positions[suffix]


class SuffixProposer:
    Options = SuffixOptions

    def __init__(
        self, *, num_tokens: int, vocab_size: int, options: SuffixOptions | None = None
    ) -> None:
        self.num_tokens = num_tokens
        self.options = options or SuffixOptions()
        self._index = SuffixIndex(self.options.max_depth)
        self._keys: dict[str, int] = {}
        self._next_key = 0
        self._finished: OrderedDict[int, None] = OrderedDict()  # cached earlier requests

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose(r) for r in requests]

    def _propose(self, request: DraftRequest) -> list[int]:
        key = self._keys.get(request.request_id)
        if key is None:
            key = self._keys[request.request_id] = self._next_key
            self._next_key += 1
        tokens = request.token_ids
        # Index everything but the last token: a match must be followed by something.
        self._index.extend(key, tokens[:-1])
        sequences = self._index.sequences
        sequences[key] = list(tokens)  # the last token is readable, not yet indexed
        limit = min(request.max_num_tokens, self.num_tokens)
        for depth in range(min(self.options.max_depth, len(tokens)), 0, -1):
            found = self._index.positions.get(tuple(tokens[len(tokens) - depth :]))
            if found:
                return self._walk(found, limit)
        return []

    def _walk(self, positions: list[Position], limit: int) -> list[int]:
        sequences = self._index.sequences
        draft: list[int] = []
        confidence = 1.0
        while len(draft) < limit:
            votes = Counter(
                sequences[k][end + 1] for k, end in positions if end + 1 < len(sequences[k])
            )
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            confidence *= count / sum(votes.values())
            if confidence < self.options.min_confidence:
                break
            draft.append(token)
            positions = [
                (k, end + 1)
                for k, end in positions
                if end + 1 < len(sequences[k]) and sequences[k][end + 1] == token
            ]
        return draft

    def request_finished(self, request_id: str) -> None:
        key = self._keys.pop(request_id, None)
        if key is None:
            return
        if self.options.cache_requests == 0:
            self._index.remove(key)
            return
        # Keep it for later requests to match against, evicting the oldest kept.
        self._index.extend(key, self._index.sequences.get(key, []))
        self._finished[key] = None
        while len(self._finished) > self.options.cache_requests:
            oldest, _ = self._finished.popitem(last=False)
            self._index.remove(oldest)


@hookimpl
def register_spec_proposers(register):
    register("suffix", SuffixProposer)
