"""One engine output → the text it adds: shared by the API server and the offline API.

The stop token that ended a request is not part of its text (unless asked), stop strings
finish a request on this side (the engine must then be told to abort it), and the text a
detokenizer held back is released when the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugserve.interfaces.frontend import Detokenizer
from plugserve.messages import EngineCoreOutput
from plugserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class TextDelta:
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    # A stop string ended the request here while the engine still runs it: abort it there.
    stopped_by_string: bool


def detokenize_output(
    detokenizer: Detokenizer, params: SamplingParams, output: EngineCoreOutput
) -> TextDelta:
    text_ids = output.new_token_ids
    if output.finish_reason == "stop" and not params.include_stop_str_in_output:
        text_ids = text_ids[:-1]  # the EOS or stop token is not part of the text
    text = detokenizer.update(text_ids)
    if detokenizer.stop_reason is not None:
        return TextDelta(text, "stop", detokenizer.stop_reason, output.finish_reason is None)
    if output.finish_reason is not None:
        text += detokenizer.flush()
    return TextDelta(text, output.finish_reason, output.stop_reason, False)
