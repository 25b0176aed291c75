"""The wrapper that gives a contract-unaware engine the workload contract, run as its own process: it says
ready-for-snapshot only once the engine answers its health URL, passes SIGTERM on and exits as the engine
did, waits as the placeholder in a restore pod without starting the engine, and refuses a missing engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo_snapshot.api import protocol

# An engine that loads for a while before it answers /health, as vLLM does while it loads its model.
ENGINE = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wrap(tmp_path: Path, args: list[str], **env: str) -> subprocess.Popen[bytes]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in (*protocol.ENV_CONTROL_DIRS, *protocol.ENV_RESTORE_STANDBYS)
    }
    return subprocess.Popen(
        [sys.executable, "-m", "dynamo_snapshot.workload.wrap", *args],
        env={**clean, **env},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_ready_for_snapshot_waits_for_the_engine_then_sigterm_reaches_it(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    port = _free_port()
    engine = tmp_path / "engine.py"
    engine.write_text(ENGINE)
    proc = _wrap(
        tmp_path,
        [
            "--ready-url",
            f"http://127.0.0.1:{port}/health",
            "--",
            sys.executable,
            str(engine),
            str(port),
            "1.5",
        ],
        **{protocol.ENV_CONTROL_DIR: str(control)},
    )
    try:
        ready = control / protocol.FILE_READY_FOR_SNAPSHOT
        time.sleep(1.0)
        assert not ready.exists(), "ready-for-snapshot before the engine answered its health URL"
        _wait_for(ready, within=20)
        payload = json.loads(ready.read_text())
        assert payload["info"]["readyUrl"].endswith("/health")
        assert payload["pid"] == proc.pid  # the wrapper, whose tree the agent checkpoints
        proc.send_signal(signal.SIGTERM)
        # The engine dies of the forwarded SIGTERM; the wrapper reports it as a shell would.
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        proc.kill()


def test_without_a_control_dir_the_engine_just_runs(tmp_path: Path) -> None:
    proc = _wrap(
        tmp_path,
        ["--ready-url", "http://127.0.0.1:1/health", "--", sys.executable, "-c", "raise SystemExit(7)"],
    )
    assert proc.wait(timeout=20) == 7


def test_a_restore_pod_waits_in_standby_and_never_starts_the_engine(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    marker = tmp_path / "engine-started"
    proc = _wrap(
        tmp_path,
        [
            "--ready-url",
            "http://127.0.0.1:1/health",
            "--",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        **{protocol.ENV_CONTROL_DIR: str(control), protocol.ENV_RESTORE_STANDBY: "1"},
    )
    try:
        _wait_for(control / protocol.FILE_RESTORE_STANDBY, within=20)
        time.sleep(0.5)
        assert proc.poll() is None, "the placeholder must wait for the restore"
        assert not marker.exists(), "a restore pod cold-started its engine"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "args", [["--ready-url", "http://x/health"], ["--ready-url", "http://x/health", "--"], []]
)
def test_a_missing_engine_or_url_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    proc = _wrap(tmp_path, args)
    assert proc.wait(timeout=20) == 2
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "engine" in err or "--ready-url" in err, err
