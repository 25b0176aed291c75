"""A tiny stand-in for vLLM workers' /metrics: settable gauges named like vLLM's, one ``pod`` label each.

Each ``FakeVllmExporter`` is its own HTTP server (in a daemon thread, on a free loopback port) with its
own prometheus_client registry, so several can run side by side, like several worker pods.

It always answers in the classic text format: prometheus_client 0.26's OpenMetrics output (what
Prometheus asks for first) writes sample names with ':' turned into '_' while keeping ':' in # TYPE,
so Prometheus would store vllm_num_requests_waiting instead of vLLM's vllm:num_requests_waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

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
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.port = int(self._server.server_address[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
