"""A stub HTTP server on a free loopback port, in a daemon thread: every GET gets what ``respond`` says.

What the tests stand up in place of a worker's /metrics or of a Prometheus that answers with an error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

# (status, Content-Type, body) for one GET.
Response = tuple[int, str, bytes]


class StubServer:
    """Serves ``respond()`` to every GET from start to ``stop()`` (or the end of a ``with`` block)."""

    def __init__(self, respond: Callable[[], Response]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, content_type, body = respond()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
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
        """``host:port``, as a Prometheus scrape target names it."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StubServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
