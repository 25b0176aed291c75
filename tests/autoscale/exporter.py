"""A tiny stand-in for vLLM workers' /metrics: settable gauges named like vLLM's, one ``pod`` label each.

Each ``FakeVllmExporter`` is its own HTTP server (a tests.helpers.stub_server.StubServer) with its
own prometheus_client registry, so several can run side by side, like several worker pods.

It always answers in the classic text format: prometheus_client 0.26's OpenMetrics output (what
Prometheus asks for first) writes sample names with ':' turned into '_' while keeping ':' in # TYPE,
so Prometheus would store vllm_num_requests_waiting instead of vLLM's vllm:num_requests_waiting.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from tests.helpers.stub_server import StubServer

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE = "vllm:kv_cache_usage_perc"

_HELP = {
    WAITING: "Number of requests waiting to be processed.",
    RUNNING: "Number of requests in model execution batches.",
    KV_CACHE: "KV-cache usage. 1 means 100 percent usage.",
}


class FakeVllmExporter:
    """Serves vLLM-named gauges labelled by pod; ``address`` is the ``host:port`` to scrape."""

    def __init__(self, pods: Iterable[str] = ("worker-0",)) -> None:
        self.pods = tuple(pods)
        self.registry = CollectorRegistry()
        self._gauges = {
            name: Gauge(name, help_text, ["pod", "model_name"], registry=self.registry)
            for name, help_text in _HELP.items()
        }
        self._server = StubServer(lambda: (200, CONTENT_TYPE_LATEST, generate_latest(self.registry)))
        self.port = self._server.port

    @property
    def address(self) -> str:
        return self._server.address

    def set(self, metric: str, value: float, pod: str | None = None) -> None:
        """Set ``metric`` for ``pod`` (the exporter's first pod when omitted)."""
        self._gauges[metric].labels(pod=pod or self.pods[0], model_name="Qwen/Qwen3-0.6B").set(value)

    def remove(self, metric: str, pod: str | None = None) -> None:
        """Stop exposing ``metric`` for ``pod`` (every pod when omitted)."""
        gauge = self._gauges[metric]
        if pod is None:
            gauge.clear()
        else:
            gauge.remove(pod, "Qwen/Qwen3-0.6B")

    def clear(self) -> None:
        """Expose no samples at all, as a worker that has not served anything yet."""
        for gauge in self._gauges.values():
            gauge.clear()

    def stop(self) -> None:
        self._server.stop()
