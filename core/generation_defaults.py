"""The model's own generation defaults, from its generation_config.json (as vLLM's
`--generation-config auto`): sampling settings a request that leaves them out gets, and
every end-of-sequence id, each of which stops generation.

Read once per API server at start, and for the EOS ids by the offline LLM and by the
engine's structured-output backend (they end a grammar too). The engine stops on the
request's `eos_token_id` (the tokenizer's) and on `SamplingParams.stop_token_ids`; the
model's other EOS ids (a chat model's end of turn, Llama 3's <|eom_id|>…) join the
request's stop_token_ids unless it sets `ignore_eos`, exactly as vLLM's `update_from_generation_config` does, so
the engine needs nothing new and a request ended by one reports it as its stop_reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from plugserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> request field; the ones vLLM takes too (less max_tokens).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """`sampling`: request field -> the model's default; `extra_eos_token_ids`: the EOS
    ids of generation_config.json besides the tokenizer's own."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    extra_eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def load(
        cls, model_path: str | Path, tokenizer_eos_id: int | None, *, use_sampling: bool = True
    ) -> GenerationDefaults:
        """Read `model_path`/generation_config.json (nothing there: no defaults). With
        `use_sampling` false (`server.generation_config: none`) its sampling settings are
        not used; its EOS ids always are (they say when the model is done)."""
        path = Path(model_path) / "generation_config.json"
        try:
            config: Any = json.loads(path.read_text())
        except FileNotFoundError:
            config = {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", path, exc)
            config = {}
        if not isinstance(config, dict):
            config = {}
        sampling: dict[str, float | int] = {}
        if use_sampling:
            for key in SAMPLING_KEYS:
                value = config.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    sampling[key] = int(value) if key == "top_k" else float(value)
        eos = config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos]
        extra = tuple(
            dict.fromkeys(
                int(t) for t in eos_ids if isinstance(t, int) and t != tokenizer_eos_id and t >= 0
            )
        )
        return cls(sampling, extra)

    def describe(self) -> str:
        """What a request gets, for the log line at start."""
        parts = [f"{k}={v}" for k, v in self.sampling.items()] or ["none"]
        text = f"sampling defaults from generation_config.json: {', '.join(parts)}"
        if self.extra_eos_token_ids:
            ids = ", ".join(map(str, self.extra_eos_token_ids))
            text += f"; its EOS ids {ids} stop generation too"
        return text

    def with_eos(self, params: SamplingParams) -> SamplingParams:
        """`params` that stop on every EOS id of the model too (unless ignore_eos)."""
        if params.ignore_eos or not self.extra_eos_token_ids:
            return params
        missing = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if not missing:
            return params
        return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])
