"""A short soak in `make test` (tests/soak/soak.py; `make soak` runs a long one through
each transport): through the shared memory transport, the one plugserve implements itself,
hundreds of requests of every kind (completions and chats, short and long
prompts, greedy and sampled, stop strings, max_tokens, n, logprobs, streamed and not), a
quarter of their clients leaving part-way. Afterwards no request failed, every one not
cancelled got a complete answer equal to the same request served alone (greedy or
seeded), no request runs or waits, every KV block is free, and every server process's
resident memory is within 10 % of its value after the warm-up."""

from __future__ import annotations

import pytest

from plugserve.bench.plugserve_server import PlugserveServer
from tests.soak.soak import soak

REQUESTS = 100
CONCURRENCY = 16


@pytest.mark.transports("shm")
def test_a_short_soak_leaves_the_server_as_it_found_it(server: PlugserveServer):
    """On the session's shared shm server: the soak's checks are relative
    to its own warm-up, and every other test leaves that server as it found it too."""
    report = soak(
        server,
        requests=REQUESTS,
        concurrency=CONCURRENCY,
        num_specs=12,
        max_tokens=(1, 4, 8),
        prompt_words=(1, 4, 16, 64),  # up to ~90 tokens
    )
    print(report.summary())
    assert not report.failures(), "\n".join([report.summary(), *report.failures()])
    assert report.requests == REQUESTS
    # The mix did happen: clients left, and the rest were checked against the reference.
    assert report.cancelled > 0
    assert report.compared > REQUESTS / 4
