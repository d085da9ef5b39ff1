"""vLLM's /tokenize and /detokenize (serving.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from plugserve.frontend.errors import InvalidRequest
from plugserve.frontend.routes.endpoint_flow import ServingDep, invalid_request_response
from plugserve.frontend.routes.tokens.protocol import DetokenizeRequest, TokenizeRequest
from plugserve.frontend.routes.tokens.serving import TokenServing
from plugserve.frontend.serving import OpenAIServing

router = APIRouter()


def _tokens(serving: OpenAIServing) -> TokenServing:
    return TokenServing(serving.renderer, serving.model_name, serving.max_model_len)


def _answer(work: Callable[[], dict[str, Any]]) -> Response:
    try:
        return JSONResponse(work())
    except InvalidRequest as exc:
        return invalid_request_response(exc)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> Response:
    return _answer(lambda: _tokens(serving).tokenize(body))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> Response:
    return _answer(lambda: _tokens(serving).detokenize(body))
