"""POST /v1/completions: the route, its serving and its body."""
