"""A test plugin: a metrics plugin adding its own figures to /metrics through the
`register_metrics` hook, once per API-server process: a custom collector (which says
which process answered the scrape) and a prometheus-client counter (one per process, so
that with two API servers the sum served is 2).

Loaded by the server under test through PLUGSERVE_PLUGIN_MODULES, so it must stay
importable as `tests.integration.metrics_plugin` from the repository root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from plugserve import hookimpl

ANSWERED_BY = "plugserve_test_answering_pid"
REGISTRATIONS = "plugserve_test_metrics_registrations"


class AnsweringProcess:
    """A custom collector: collect() runs at each scrape, in the process answering it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            ANSWERED_BY, "The API-server process that answered this scrape.", labels=["model_name"]
        )
        family.add_metric([self.model_name], os.getpid())
        yield family


@hookimpl
def register_metrics(registry: Any, model_name: str) -> None:
    registry.register(AnsweringProcess(model_name))
    Counter(
        REGISTRATIONS, "register_metrics calls: one per API-server process.", registry=registry
    ).inc()
