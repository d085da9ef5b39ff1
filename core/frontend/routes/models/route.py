"""GET /v1/models: the one model this server serves, as vLLM lists it."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter

from plugserve.frontend.routes.endpoint_flow import ServingDep

router = APIRouter()


@router.get("/v1/models")
async def models(serving: ServingDep) -> dict[str, Any]:
    """vLLM's model card: `root` is the model as configured, `parent` null (no
    adapters), `permission` the one entry vLLM sends."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": serving.model_name,
                "object": "model",
                "created": created,
                "owned_by": "plugserve",
                "root": serving.model_root,
                "parent": None,
                "max_model_len": serving.max_model_len,
                # What the model serves: generate, or its pooling tasks (embed, classify, ...).
                "task": list(serving.pooling.tasks) if serving.pooling.is_pooling else ["generate"],
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
