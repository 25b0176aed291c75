"""Liveness and readiness endpoints for the long-running commands, for kubelet's HTTP probes.

`GET /healthz` answers 200 while the process is alive and its event loop runs: the answer is produced on
the same loop as the controller's or agent's work, so a loop that is blocked (a synchronous call, a
runaway callback) answers nothing and the probe's timeout fails it. `GET /readyz` answers 200 when the
service's own readiness check passes (caches synced, ...), 503 with the reason otherwise.

Served by aiohttp, which the Kubernetes client already brings: request parsing and its limits are the
framework's. No access log: kubelet probes every few seconds, and a line per probe would bury the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Final

from aiohttp import web

log = logging.getLogger(__name__)

# Returns None when healthy, else the reason it is not (one line).
Check = Callable[[], str | None]

# Connections are closed after each answer (as kubelet's probes ask anyway), so a stop has no idle
# keep-alive connection to wait for; this bounds the wait for one that is mid-request.
_SHUTDOWN_TIMEOUT_S: Final = 1.0


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
        self._runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        addresses = self._runner.addresses if self._runner is not None else []
        if not addresses:
            raise RuntimeError("health server is not listening")
        return int(addresses[0][1])

    async def start(self) -> None:
        app = web.Application()
        # Every path and method reaches one handler, so unknown ones get the same plain-text answers.
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.requested_port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

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

    async def _handle(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            status, body = 405, "only GET and HEAD\n"
        else:
            status, body = self.evaluate(request.rel_url.raw_path)
        response = web.Response(status=status, text=body, charset="utf-8")
        response.force_close()
        return response


def distinct_ports(metrics_port: int, health_port: int) -> None:
    """Refuse one port for both servers: the second bind would fail, or the probes would be answered by
    the metrics server (200 on any path) and pass however the process is doing."""
    if metrics_port and metrics_port == health_port:
        raise ValueError(f"metricsPort and healthPort are both {metrics_port}: give them different ports")


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
