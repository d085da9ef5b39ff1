"""The API server's HTTP endpoints, one folder per endpoint family, each holding its
route (route.py) and, where they are its own, its serving (serving.py) and request
bodies (protocol.py):

- chat/: /v1/chat/completions          - completions/: /v1/completions
- responses/: /v1/responses            - models/: /v1/models
- messages/: /v1/messages (Anthropic's), /v1/messages/count_tokens
- tokens/: /tokenize, /detokenize      - health/: /health, /ping, /version
- metrics/: /metrics                   - bench/: /bench/weight_read
- embeddings/: /v1/embeddings          - pooling/: /pooling
- classify/: /classify                 - score/: /score
- rerank/: /rerank, /v1/rerank, /v2/rerank

What they share is owned by none: endpoint_flow.py (dependencies, OpenAI's error shape,
a generating request from a valid body to its last byte) over frontend/serving.py.

They join the app through the `register_routes` hook, as a plugin's endpoints do
(frontend/route_registration.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugserve import hookimpl

if TYPE_CHECKING:
    from plugserve.interfaces.frontend import ApiServer


@hookimpl
def register_routes(server: ApiServer) -> None:
    """The bundled endpoints, registered as a plugin's are (the registry calls this first).
    Imported here, not above: every process loads the registry, only an API server
    builds an app."""
    from plugserve.frontend.routes.bench import route as bench
    from plugserve.frontend.routes.chat import route as chat
    from plugserve.frontend.routes.classify import route as classify
    from plugserve.frontend.routes.completions import route as completions
    from plugserve.frontend.routes.embeddings import route as embeddings
    from plugserve.frontend.routes.health import route as health
    from plugserve.frontend.routes.messages import route as messages
    from plugserve.frontend.routes.metrics import route as metrics
    from plugserve.frontend.routes.models import route as models
    from plugserve.frontend.routes.pooling import route as pooling
    from plugserve.frontend.routes.rerank import route as rerank
    from plugserve.frontend.routes.responses import route as responses
    from plugserve.frontend.routes.score import route as score
    from plugserve.frontend.routes.tokens import route as tokens

    for endpoint in (
        chat, completions, responses, messages, embeddings, pooling, classify, score,
        rerank, models, tokens, health, bench, metrics,
    ):  # fmt: skip
        server.include_router(endpoint.router)
