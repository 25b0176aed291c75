"""Liveness and readiness endpoints for the long-running commands, for kubelet's HTTP probes.

`GET /healthz` answers 200 while the process is alive and its event loop runs: the answer is produced on
the same loop as the controller's or agent's work, so a loop that is blocked (a synchronous call, a
runaway callback) answers nothing and the probe's timeout fails it. `GET /readyz` answers 200 when the
service's own readiness check passes (caches synced, ...), 503 with the reason otherwise.

A minimal HTTP/1.1 responder on `asyncio.start_server` rather than a web framework: two fixed paths, no
bodies to parse, nothing that could block the loop, and no dependency beyond the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Final

log = logging.getLogger(__name__)

# Returns None when healthy, else the reason it is not (one line).
Check = Callable[[], str | None]

_MAX_REQUEST_HEAD: Final = 8192
# A probe sends its request at once; a client that trickles bytes must not hold a coroutine for long.
_READ_TIMEOUT_S: Final = 5.0
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


class HealthServer:
    """Serves `/healthz` (liveness: `live`) and `/readyz` (readiness: `ready`) on `host:port`.

    `port=0` binds an ephemeral port (`.port` says which). `host=None` listens on every interface, IPv4
    and IPv6, as a pod's probes may come over either.
    """

    def __init__(
        self,
        port: int,
        *,
        host: str | None = None,
        live: Check | None = None,
        ready: Check | None = None,
    ) -> None:
        self.host = host
        self.requested_port = port
        self._checks: dict[str, Check | None] = {"/healthz": live, "/readyz": ready}
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("health server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.requested_port, limit=_MAX_REQUEST_HEAD
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def evaluate(self, path: str) -> tuple[int, str]:
        """Status code and body for a GET of `path` (query string already removed)."""
        if path not in self._checks:
            return 404, "not found\n"
        check = self._checks[path]
        try:
            problem = check() if check is not None else None
        except Exception as e:  # a broken check is a failing check, never a crashed server
            problem = f"check failed: {type(e).__name__}: {e}"
        if problem:
            return 503, f"{problem}\n"
        return 200, "ok\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
                return  # nothing sensible to answer; just hang up
            method, path, ok = _request_line(head)
            if not ok:
                status, body = 400, "bad request\n"
            elif method not in ("GET", "HEAD"):
                status, body = 405, "only GET and HEAD\n"
            else:
                status, body = self.evaluate(path)
            payload = body.encode()
            response = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                "Content-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("ascii")
            writer.write(response if method == "HEAD" else response + payload)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except Exception:
            log.exception("health request failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


def distinct_ports(metrics_port: int, health_port: int) -> None:
    """Refuse one port for both servers: the second bind would fail, or the probes would be answered by
    the metrics server (200 on any path) and pass however the process is doing."""
    if metrics_port and metrics_port == health_port:
        raise ValueError(f"metricsPort and healthPort are both {metrics_port}: give them different ports")


def _request_line(head: bytes) -> tuple[str, str, bool]:
    """(method, path without query, well-formed?) from the request head."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return "", "", False
    return parts[0], parts[1].split("?", 1)[0], True


async def start_health_server(port: int, *, ready: Check | None = None) -> HealthServer | None:
    """Start the endpoints on `port`, or None when `port` is 0 (disabled) or cannot be bound.

    A port that is taken is logged, not fatal: the probes then fail and say so where it matters (the pod's
    events), while the service itself does its work, as it did before it had health endpoints.
    """
    if not port:
        return None
    # Every interface first; IPv4 alone where the pod's IPv6 is switched off and `::` cannot be bound.
    for host in (None, "0.0.0.0"):
        server = HealthServer(port, host=host, ready=ready)
        try:
            await server.start()
            break
        except OSError as e:
            error = e
    else:
        log.warning("health endpoints disabled: cannot listen", extra={"port": port, "error": str(error)})
        return None
    log.info("health endpoints listening", extra={"port": port, "paths": ["/healthz", "/readyz"]})
    return server


class Readiness:
    """The `/readyz` check of a service whose object is built after its endpoints start: `starting` until
    `use` names the real check."""

    def __init__(self, starting: str) -> None:
        self._check: Check = lambda: starting

    def use(self, check: Check) -> None:
        self._check = check

    def __call__(self) -> str | None:
        return self._check()


@contextlib.asynccontextmanager
async def health_endpoints(port: int, *, starting: str) -> AsyncIterator[Readiness]:
    """Serve `/healthz` and `/readyz` on `port` for the duration of the block (nothing when `port` is 0,
    or when it cannot be bound; see `start_health_server`). `/readyz` answers `starting` until the block
    hands the service's check to the `Readiness` it gets."""
    readiness = Readiness(starting)
    server = await start_health_server(port, ready=readiness)
    try:
        yield readiness
    finally:
        if server is not None:
            await server.close()
