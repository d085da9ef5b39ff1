"""vLLM's /tokenize and /detokenize: the route, its serving and its bodies."""
