"""The API server's HTTP routes, one router per endpoint family:

- openai.py: /v1/chat/completions, /v1/completions, /v1/models
- health.py: /health, /version
- metrics.py: /metrics (Prometheus)
- bench.py: /bench/weight_read

api_server.build_app includes them; what they share (the engine client, the OpenAI
serving layer, OpenAI's error shape) is in shared.py.
"""
