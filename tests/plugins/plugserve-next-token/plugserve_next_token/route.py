"""POST /v1/next_token: its bodies and its route."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from plugserve import SamplingParams
from plugserve.interfaces.frontend import ApiServer

# What JSON carries of a logprob no float can (a token ruled out has -inf).
MIN_LOGPROB = -9999.0


class NextTokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    top_logprobs: int = Field(5, ge=0, le=20)


class Alternative(BaseModel):
    token: str
    token_id: int
    logprob: float


class NextToken(BaseModel):
    token: str
    token_id: int
    logprob: float
    top_logprobs: list[Alternative]


def next_token_router(server: ApiServer) -> APIRouter:
    router = APIRouter()
    tokenizer = server.renderer.tokenizer

    @router.post("/v1/next_token")
    async def next_token(body: NextTokenRequest) -> NextToken:
        prompt_ids = server.renderer.encode(body.prompt)
        if not 0 < len(prompt_ids) < server.max_model_len:
            # An HTTPException is answered in OpenAI's error shape, as the server's own are.
            raise HTTPException(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                f"{server.max_model_len}, the next token included",
            )
        params = SamplingParams(
            temperature=0, max_tokens=1, logprobs=body.top_logprobs, ignore_eos=True
        )
        token_ids, logprobs = [], []
        request_id = f"next-token-{uuid.uuid4().hex}"
        async for delta in server.engine_client.generate(request_id, prompt_ids, params):
            token_ids += delta.token_ids
            logprobs += delta.logprobs or []
        [token_id], [chosen] = token_ids, logprobs
        return NextToken(
            token=tokenizer.decode([token_id]),
            token_id=token_id,
            logprob=max(chosen.sampled_logprob, MIN_LOGPROB),
            top_logprobs=[
                Alternative(token=tokenizer.decode([t]), token_id=t, logprob=max(v, MIN_LOGPROB))
                for t, v in zip(chosen.top_token_ids, chosen.top_logprobs, strict=True)
            ],
        )

    return router
