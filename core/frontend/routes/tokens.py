"""vLLM's /tokenize and /detokenize (serving_tokens.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.protocol import DetokenizeRequest, TokenizeRequest
from plugserve.frontend.routes.shared import Serving, error_response
from plugserve.frontend.serving_tokens import TokenServing

router = APIRouter()


def _tokens(serving: Any) -> TokenServing:
    return TokenServing(serving.renderer, serving.model_name, serving.max_model_len)


def _answer(work: Any) -> Response:
    try:
        return JSONResponse(work())
    except ModelNotFound as exc:
        return error_response(404, str(exc), "invalid_request_error", "model")
    except InvalidRequest as exc:
        return error_response(400, str(exc), "invalid_request_error", exc.param)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Serving) -> Response:
    return _answer(lambda: _tokens(serving).tokenize(body))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Serving) -> Response:
    return _answer(lambda: _tokens(serving).detokenize(body))
