"""A third-party detokenizer, the smallest real one: the whole output decoded again at
every update. Quadratic in the output's length, where the bundled `incremental` one
decodes a window, but with nothing to keep in step.

Loaded through PLUGSERVE_PLUGIN_MODULES=tests.plugins.minimal.detokenizer;
tests/plugins/test_minimal_plugins.py selects it.
"""

from __future__ import annotations

from typing import Any

from plugserve import hookimpl
from plugserve.hookspecs import Register
from plugserve.sampling_params import SamplingParams

# What a decode ends in while the last character's bytes are not all there yet.
INCOMPLETE = "\ufffd"


class WholeTextDetokenizer:
    """interfaces.frontend.Detokenizer: new ids → the text they add, and stop strings."""

    def __init__(
        self, *, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.stop_reason: str | None = None
        self._ids: list[int] = []
        self._stops = [stop for stop in params.stop if stop]
        self._final = False

    def update(self, new_token_ids: list[int]) -> str:
        if self._final:
            return ""
        self._ids += new_token_ids
        text = self._decode()
        if len(self._ids) > self.params.min_tokens:
            found = [(at, s) for s in self._stops if (at := self._find(text, s)) >= 0]
            if found:
                at, stop = min(found)
                self.stop_reason, self._final = stop, True
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                return self._release(text[:end])
        return self._release(self._without_open_ends(text))

    def flush(self) -> str:
        if self._final:
            return ""
        self._final = True
        return self._release(self._decode())

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self._ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _find(self, text: str, stop: str) -> int:
        """Where `stop` first occurs ending in text not released yet; -1 if nowhere."""
        return text.find(stop, max(0, len(self.output_text) - len(stop) + 1))

    def _without_open_ends(self, text: str) -> str:
        """Holds back a character still missing bytes and, unless stop strings are shown,
        a tail that may yet grow into one: a client never sees either change later."""
        text = text.rstrip(INCOMPLETE)
        if self.params.include_stop_str_in_output:
            return text
        unreleased = len(text) - len(self.output_text)
        longest = max(map(len, self._stops), default=1) - 1
        for size in range(min(unreleased, longest), 0, -1):
            if any(stop.startswith(text[-size:]) for stop in self._stops):
                return text[:-size]
        return text

    def _release(self, text: str) -> str:
        """The part of `text` past what was released before."""
        new = text[len(self.output_text) :]
        self.output_text += new
        return new


@hookimpl
def register_detokenizers(register: Register) -> None:
    register("whole_text", WholeTextDetokenizer)
