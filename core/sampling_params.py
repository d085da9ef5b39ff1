"""SamplingParams: how one request turns logits into tokens and when it stops.

A msgspec Struct because it crosses the process boundary inside every new request.
Validation raises ValueError with a message a user can act on; the HTTP layer turns
it into a 400.
"""

from __future__ import annotations

import sys

import msgspec

_GREEDY_EPS = 1e-5
# A subnormal value of these is zero: an engine process that loaded a library built with
# -ffast-math (GCC's crtfastmath sets FTZ/DAZ) compares it as zero, so every process must
# judge it so, or the API server accepts what the engine then refuses.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """One constraint on the output, as vLLM's `structured_outputs` request field: exactly
    one of the fields is set. The engine compiles it with the stack's structured-output
    backend (interfaces.structured_output.StructuredOutputBackend) and masks every sampling step with it."""

    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                f"structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {found}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what the grammar cache is keyed by."""
        if self.json is not None:
            return ("json", self.json)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", "\x00".join(self.choice))
        return ("grammar", self.grammar or "")


class ReasoningParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """The output opens with the model's reasoning, which ends at the stack's reasoning
    parser's end marker: `end_token_ids`, the marker's own id where it is a token of its
    own, else (with `end_text`, the marker as text) the first place the output's text
    shows `end_text`, whatever tokens spell it, as the parser finds it. Until then the
    request's grammar, if any, neither masks nor advances: a constraint applies to the
    answer only. With `budget`, once that many reasoning tokens are out the engine forces
    the end marker (`end_token_ids`, the rest of it if the output began it) through the
    bitmask."""

    end_token_ids: list[int]
    end_text: str | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.end_token_ids:
            raise ValueError("a reasoning end marker needs at least one token id")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"the thinking budget must be at least 1 token, got {self.budget}")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token is a candidate
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the sampled token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Token sequences that must never be completed: the frontend tokenizes the request's
    # bad_words (with and without a leading space, as vLLM) into these.
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # Completions: logprobs of each prompt token given the ones before (top-N alternatives).
    prompt_logprobs: int | None = None
    # Set when the output starts inside the model's reasoning (a reasoning parser is
    # configured and the prompt leaves the thinking open).
    reasoning: ReasoningParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value != 0.0 and abs(value) < sys.float_info.min:
                setattr(self, name, 0.0)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            (
                all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids must not be empty",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
