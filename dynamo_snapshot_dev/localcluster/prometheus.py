"""A real Prometheus server for tests and the local demo, scraping given targets every second.

Uses the Debian package's ``/usr/bin/prometheus`` (installed by ``scripts/test-env.sh``), started as a
supervised child process like the control plane: its own config, TSDB and log in a work directory, a
free loopback port, and a clean stop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dynamo_snapshot_dev.localcluster.cluster import free_port
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError
from dynamo_snapshot_dev.localcluster.supervise import Started, die_with_parent, log_tail

__all__ = ["DEFAULT_PROMETHEUS", "LocalPrometheus", "LocalPrometheusError", "find_prometheus"]

DEFAULT_PROMETHEUS = Path("/usr/bin/prometheus")
MISSING_MESSAGE = "prometheus is missing: run scripts/test-env.sh"


class LocalPrometheusError(RuntimeError):
    """A one-line, actionable reason Prometheus could not start or be reconfigured."""


def find_prometheus(binary: Path | None = None) -> Path:
    """The prometheus binary: ``binary``, else /usr/bin/prometheus, else one on PATH."""
    candidates = [binary] if binary is not None else [DEFAULT_PROMETHEUS]
    if binary is None and (found := shutil.which("prometheus")):
        candidates.append(Path(found))
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    raise ComponentsMissingError(f"{MISSING_MESSAGE} (looked for {', '.join(map(str, candidates))})")


class LocalPrometheus(Started):
    """Prometheus on ``host`` (127.0.0.1 unless pods query it) at a free port, scraping ``targets``
    (``host:port``) every second.

    ``start()`` returns once ``/-/ready`` answers; ``url`` is then the base URL for queries.
    ``set_targets()`` changes what is scraped without a restart.  Without ``workdir`` the config,
    TSDB and log go to a temporary directory that ``stop()`` removes.
    """

    def __init__(
        self,
        targets: Sequence[str] = (),
        *,
        workdir: Path | None = None,
        binary: Path | None = None,
        scrape_interval_s: float = 1.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.targets = list(targets)
        self.host = host
        self.scrape_interval_s = scrape_interval_s
        self._binary = binary
        self._given_workdir = workdir
        self.workdir: Path | None = workdir
        self.port = 0
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None
        self._own_workdir = False

    # ------------------------------------------------------------------ public surface
    @property
    def url(self) -> str:
        if not self.port:
            raise LocalPrometheusError("LocalPrometheus is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def log(self) -> Path:
        return self._dir / "prometheus.log"

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        binary = find_prometheus(self._binary)
        if self._popen is not None:
            raise LocalPrometheusError("LocalPrometheus is already started")
        if self._given_workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="dynsnap-prometheus-"))
            self._own_workdir = True
        self._dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self.port = free_port()
        self._log_handle = self.log.open("ab")
        self._popen = subprocess.Popen(
            [
                str(binary),
                f"--config.file={self._config}",
                f"--storage.tsdb.path={self._dir / 'tsdb'}",
                f"--web.listen-address={self.host}:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._popen.poll() is not None:
                code = self._popen.returncode
                tail = self.log_tail(8)
                self.stop()
                raise LocalPrometheusError(f"prometheus exited with {code}; log {self.log}:\n{tail}")
            if self._get("/-/ready") is not None:
                return
            time.sleep(0.1)
        self.stop()
        raise LocalPrometheusError(f"prometheus did not become ready in {timeout:g}s; see {self.log}")

    def stop(self) -> None:
        popen, self._popen = self._popen, None
        if popen is not None:
            if popen.poll() is None:
                popen.terminate()
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=5)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
            self._own_workdir = False

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape ``targets`` from now on (config rewritten and reloaded in place)."""
        self.targets = list(targets)
        self._write_config()
        if self.running:
            request = urllib.request.Request(self.url + "/-/reload", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=10):
                    pass
            except (urllib.error.URLError, OSError) as e:
                raise LocalPrometheusError(f"prometheus did not reload its config: {e}") from None

    def wait_targets_up(self, timeout: float = 15.0) -> None:
        """Wait until every target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout
        health: dict[str, str] = {}
        while time.monotonic() < deadline:
            body = self._get("/api/v1/targets?state=active")
            if body is not None:
                active = json.loads(body)["data"]["activeTargets"]
                health = {t["labels"]["instance"]: t["health"] for t in active}
                if set(health) == set(self.targets) and all(h == "up" for h in health.values()):
                    return
            time.sleep(0.1)
        raise LocalPrometheusError(f"targets not all up after {timeout:g}s: {health or 'none active'}")

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)

    # ------------------------------------------------------------------ internals
    @property
    def _dir(self) -> Path:
        if self.workdir is None:
            raise LocalPrometheusError("LocalPrometheus is not started")
        return self.workdir

    @property
    def _config(self) -> Path:
        return self._dir / "prometheus.yml"

    def _write_config(self) -> None:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config: dict[str, Any] = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "scrape_configs": [{"job_name": "targets", "static_configs": [{"targets": self.targets}]}],
        }
        if self.workdir is None:
            return
        tmp = self._config.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2))  # JSON is YAML with every string quoted
        tmp.replace(self._config)

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as response:
                body: bytes = response.read()
                return body if response.status == 200 else None
        except (urllib.error.URLError, OSError):
            return None
