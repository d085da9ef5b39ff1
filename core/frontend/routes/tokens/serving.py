"""vLLM's /tokenize and /detokenize: the served tokenizer and chat template, without
the engine. A chat tokenized here is exactly the prompt a chat completion with the same
messages sends to the engine (its usage's prompt_tokens)."""

from __future__ import annotations

from typing import Any

from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.routes.tokens.protocol import DetokenizeRequest, TokenizeRequest
from plugserve.frontend.serving import render_chat_request
from plugserve.interfaces.frontend import Renderer


class TokenServing:
    def __init__(self, renderer: Renderer, model_name: str, max_model_len: int) -> None:
        self.renderer = renderer
        self.tokenizer: Any = renderer.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`."
            )

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        if body.prompt is not None:
            add_special = body.add_special_tokens is not False
            tokens = self.renderer.encode(body.prompt, add_special_tokens=add_special)
        else:
            tokens = render_chat_request(self.renderer, body)
            if body.add_special_tokens:
                tokens = self._with_special_tokens(tokens)
        token_strs = (
            self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        )
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }

    def _with_special_tokens(self, tokens: list[int]) -> list[int]:
        """`tokens` wrapped in what the tokenizer adds around a text (BOS, …): found by
        encoding a probe with and without them."""
        plain = self.renderer.encode("a", add_special_tokens=False)
        full = self.renderer.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start] + tokens + full[start + len(plain) :]
        return tokens

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequest(f"tokens must be in [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}
