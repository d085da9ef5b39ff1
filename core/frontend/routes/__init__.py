"""The API server's HTTP endpoints, one folder per endpoint family, each holding its
route (route.py) and, where they are its own, its serving (serving.py) and request
bodies (protocol.py):

- chat/: /v1/chat/completions          - completions/: /v1/completions
- responses/: /v1/responses            - models/: /v1/models
- tokens/: /tokenize, /detokenize      - health/: /health, /ping, /version
- metrics/: /metrics                   - bench/: /bench/weight_read

What they share is owned by none: endpoint_flow.py (dependencies, OpenAI's error shape,
a generating request from a valid body to its last byte) over frontend/serving.py.
"""
