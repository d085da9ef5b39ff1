"""The `incremental` detokenizer: new token ids → new text, and stop strings (phase 11).

One instance per request, in the API-server process. Decoding the whole output again on
every step would be correct but quadratic, and decoding each token on its own is wrong:
a character can be split across tokens (byte-level BPE spells CJK and emoji as several
byte tokens) and some tokenizers (SentencePiece) only spell a token's leading space
correctly when they see the token before it. So, as vLLM and TGI do, the detokenizer
keeps a small window of ids: a context part that is already text, and the pending ids
after it. It decodes the window twice, with and without the pending ids, and the
difference is the new text, released once it no longer ends in an incomplete character
(U+FFFD); of a run of U+FFFD at the end, all but the last three are final (they cannot
become part of a character any more) and are released at once.

Stop strings are searched only in the text that just arrived plus the few characters
before it that a match could start in. When `include_stop_str_in_output` is off, the
returned text also holds back any tail that is the beginning of a stop string, so a
client never sees part of a stop string that completes a token later; `flush()`
releases it when the request ends for another reason.
"""

from __future__ import annotations

from typing import Any

from plugserve import hookimpl
from plugserve.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Bytes of a character that can still be missing at the end of the decoded text.
_MAX_PENDING_BYTES = 3

# Prompt ids kept as decoding context for the first generated tokens, so that their
# leading spaces come out as they would in the middle of the text (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request incremental detokenizer with stop-string detection.

    `output_text` is always exactly the concatenation of the strings returned by
    `update()` and `flush()`. After a stop string matched (`stop_reason` set) the text is
    cut before the stop string, or just after it with `include_stop_str_in_output`, and
    later ids are ignored.

    The caller must call `flush()` once when the request finishes for any reason other
    than a stop string (EOS, stop token, length, abort): until then the returned text may
    lag behind the decoded text by a possible beginning of a stop string, or by the bytes
    of a character not yet complete.
    """

    def __init__(
        self, *, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust decode directly: what transformers' decode ends in when
        # it cleans up no spaces, minus a Python wrapper that cost more than the decode
        # itself on every streamed token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        self.output_text = ""
        self.stop_reason: str | None = None

        self._skip_special_tokens = params.skip_special_tokens
        # An empty stop string would match everywhere; OpenAI ignores it, so do we.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in params.stop if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        self._finished = False

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would misalign the text difference below; the
        # generated text then decodes on its own, as it would in a full decode.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        # _window[:_read_offset] is decoded context; the ids after it are pending.
        self._window: list[int] = context
        self._read_offset = len(context)
        # Decoded text not returned yet: always a proper prefix of some stop string.
        self._held = ""
        # Characters of the pending ids' text already returned (final text before an
        # incomplete character at the end).
        self._released = 0

    @property
    def num_output_tokens(self) -> int:
        """Generated ids passed to `update()` so far (ids after a stop included)."""
        return self._num_output_tokens

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush()` was called: the text is final."""
        return self._finished

    def update(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they add (possibly empty).

        Checks stop strings on the new text; on a match sets `stop_reason`, cuts the
        text and returns what remains before the cut. Ignores ids after the text is final.
        """
        if self._finished or not new_token_ids:
            return ""
        self._num_output_tokens += len(new_token_ids)
        self._window.extend(new_token_ids)
        return self._append(self._decode_pending(force=False))

    def flush(self) -> str:
        """End the request: return the text still held back, and mark the text final.

        Decodes pending ids even if they end in an incomplete character (it then ends in
        U+FFFD, as a full decode would) and releases held-back text that could have begun
        a stop string. Idempotent: later calls return "".
        """
        if self._finished:
            return ""
        delta = self._append(self._decode_pending(force=True))
        if not self._finished:
            delta += self._held
            self.output_text += self._held
            self._held = ""
            self._finished = True
        return delta

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: list[int]) -> str:
        # Cleanup of tokenization spaces (" ." → ".") is a global rewrite: applied to a
        # window it can disagree with the full text, and it mangles code.
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_pending(self, *, force: bool) -> str:
        """The text the pending ids add after the context; "" while it is not ready."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[: self._read_offset])
        full_text = self._decode(self._window)
        start = len(prefix_text) + self._released
        if not force:
            # Nothing new (skipped special tokens): keep the ids pending.
            if len(full_text) <= start:
                return ""
            if full_text.endswith(_REPLACEMENT_CHAR):
                # The ids may end inside a character: keep them pending with their context
                # until the next ids complete it. Only the last few U+FFFD can still become
                # part of a character (one has at most 4 bytes); text before them is final
                # and streams now, or output that is invalid UTF-8 would arrive all at once.
                run = len(full_text) - len(full_text.rstrip(_REPLACEMENT_CHAR))
                final = full_text[start : len(full_text) - min(run, _MAX_PENDING_BYTES)]
                self._released += len(final)
                return final
        new_text = full_text[start:]
        # The ids just decoded become the next context; older ids are never needed again.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._released = 0
        return new_text

    # ------------------------------------------------------------------ stop strings

    def _append(self, new_text: str) -> str:
        """Add decoded text; check stop strings; return the part that may be released."""
        if not new_text:
            return ""
        pending = self._held + new_text
        # vLLM semantics: stop strings do not fire until min_tokens ids were generated.
        if self._stops and self._num_output_tokens > self._min_tokens:
            # A match that ends in new_text starts at most max_stop_len - 1 chars before it.
            lookback_len = min(self._max_stop_len - 1, len(self.output_text))
            lookback = self.output_text[len(self.output_text) - lookback_len :]
            match = self._find_stop(lookback + pending, len(lookback) + len(self._held))
            if match is not None:
                stop, start = match
                cut = (start + len(stop) if self._include_stop else start) - lookback_len
                # Held-back text always covers a stop string's partial beginning, so the
                # cut never falls inside text that was already returned.
                assert cut >= 0, "stop string began inside text already returned"
                self.stop_reason = stop
                self._finished = True
                self._held = ""
                delta = pending[:cut]
                self.output_text += delta
                return delta
        hold = 0 if self._include_stop else self._partial_stop_len(pending)
        delta = pending[: len(pending) - hold]
        self._held = pending[len(pending) - hold :]
        self.output_text += delta
        return delta

    def _find_stop(self, text: str, new_from: int) -> tuple[str, int] | None:
        """The stop string that completes first in `text[new_from:]`, and where it starts.

        Only matches ending in the new text count: older text was checked when it
        arrived (or arrived before min_tokens, when stop strings do not apply). "First" is
        by end position, so that the result does not depend on how the text was split
        into updates; among matches ending together the longest wins.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else (best[2], best[1])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


@hookimpl
def register_detokenizers(register):
    register("incremental", IncrementalDetokenizer)
