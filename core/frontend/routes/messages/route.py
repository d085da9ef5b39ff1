"""POST /v1/messages and POST /v1/messages/count_tokens (serving.py), Anthropic's
Messages API: every error in Anthropic's shape (errors.py), a body that fails validation
and the API-key gate's answer included."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from plugserve.frontend.errors import InvalidRequest, ModelNotFound
from plugserve.frontend.middleware import ERROR_SHAPES
from plugserve.frontend.routes.endpoint_flow import (
    STREAMED_RESPONSES,
    EngineClientDep,
    ServingDep,
    answer,
    validation_message,
)
from plugserve.frontend.routes.messages.errors import (
    AnthropicError,
    anthropic_error_response,
    reshaped,
)
from plugserve.frontend.routes.messages.protocol import CountTokensRequest, MessagesRequest
from plugserve.frontend.routes.messages.serving import MessagesServing

PATH = "/v1/messages"
ERROR_SHAPES[PATH] = anthropic_error_response


class AnthropicErrorsRoute(APIRoute):
    """A route whose every error, its body's validation included, is in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shaped(request: Request) -> Response:
            try:
                response = await handler(request)
            except RequestValidationError as exc:
                return anthropic_error_response(400, validation_message(exc)[0])
            except HTTPException as exc:
                return anthropic_error_response(exc.status_code, str(exc.detail))
            return reshaped(response)

        return shaped


router = APIRouter(route_class=AnthropicErrorsRoute)
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    "default": {"model": AnthropicError, "description": "An error, in Anthropic's shape"}
}


@router.post(PATH, responses={**STREAMED_RESPONSES, **ANTHROPIC_ERRORS})
async def messages(
    body: MessagesRequest, request: Request, client: EngineClientDep, serving: ServingDep
) -> Response:
    anthropic = MessagesServing(serving)
    return await answer(
        request,
        client,
        lambda: anthropic.prepare(body, request.state.request_id),
        stream=body.stream,
        events=anthropic.stream,
        complete=anthropic.create,
    )


@router.post(f"{PATH}/count_tokens", responses=ANTHROPIC_ERRORS)
async def count_tokens(body: CountTokensRequest, serving: ServingDep) -> Response:
    try:
        return JSONResponse(MessagesServing(serving).count_tokens(body))
    except ModelNotFound as exc:
        return anthropic_error_response(404, str(exc))
    except InvalidRequest as exc:
        return anthropic_error_response(400, str(exc))
