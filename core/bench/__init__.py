"""`plugserve bench serve`: an online serving benchmark for any OpenAI-compatible server.

A re-implementation of `vllm bench serve` for the one workload plugserve is measured on:
random-token prompts of an exact length, streaming /v1/completions (or chat), all
requests created at t=0 (or Poisson arrivals) and capped by --max-concurrency. Its
definitions, its printed table and its JSON keys are vLLM's, so figures from either
client can sit side by side:

* TTFT: from sending the request to the first streamed chunk carrying choices;
* ITL: the gaps between successive such chunks, pooled over all requests;
* TPOT: per request, (E2EL - TTFT) / (output tokens - 1), for requests of more than one
  output token;
* E2EL: from sending the request to its last chunk carrying choices;
* output tokens: the usage chunk's completion_tokens, else the generated text
  re-tokenized.

    plugserve bench serve --base-url http://127.0.0.1:8000 --max-concurrency 8 --ignore-eos

dataset: the random prompts; metrics: RequestOutput, vLLM's metrics and table; client:
the flags, the requests, the run and the entry point. server_process and plugserve_server:
the server the tests and the benchmarks drive, as a child process.
"""

from plugserve.bench.client import (
    _arrivals,
    add_cli_args,
    build_parser,
    main,
    parse_args,
    run_benchmark,
    send_request,
)
from plugserve.bench.dataset import (
    allowed_token_ids,
    get_tokenizer,
    random_prompt,
    sample_random_prompts,
)
from plugserve.bench.metrics import (
    METRICS,
    RequestOutput,
    _p_word,
    calculate_metrics,
    format_result,
)

__all__ = [
    "METRICS",
    "RequestOutput",
    "_arrivals",
    "_p_word",
    "add_cli_args",
    "allowed_token_ids",
    "build_parser",
    "calculate_metrics",
    "format_result",
    "get_tokenizer",
    "main",
    "parse_args",
    "random_prompt",
    "run_benchmark",
    "sample_random_prompts",
    "send_request",
]
