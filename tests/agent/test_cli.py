"""`dynamo-snapshot checkpoint / restore / inspect` on a real process, without Kubernetes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.polling import wait_file

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "cpu_worker.py"


def test_checkpoint_restore_inspect_round_trip(criu_bin: Path, tmp_path: Path) -> None:
    control, store = tmp_path / "control", tmp_path / "store"
    control.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SNAPSHOT_CONTROL_DIR": str(control),
        "DYNSNAP_CRIU": str(criu_bin),
    }
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        wait_file(control / "ready-for-snapshot", settle=0.05)
        identity = tmp_path / "identity.yaml"
        identity.write_text("model: Qwen/Qwen3-0.6B\nbackendFramework: sglang\n")
        done = run_cli(
            "checkpoint",
            "--pid",
            str(worker.pid),
            "--out",
            str(store),
            "--identity",
            str(identity),
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        artifact = Path(done.stdout.strip().splitlines()[-1])
        assert artifact.parent == store
        worker.wait(timeout=10)  # the dump stopped it

        shown = run_cli("inspect", str(artifact), "--verify")
        assert shown.returncode == 0, shown.stderr
        manifest = json.loads(shown.stdout)
        assert manifest["identity"]["backendFramework"] == "sglang"
        assert "verified" in shown.stderr

        restored = run_cli("restore", str(artifact), env=env, timeout=120)
        assert restored.returncode == 0, restored.stderr
        pid = int(restored.stdout.strip().splitlines()[-1])
        assert pid == worker.pid, "CRIU restores the original pid"
        try:
            verdict = json.loads(wait_file(control / "verify.json", settle=0.05))
        finally:
            os.kill(pid, signal.SIGKILL)
        assert verdict["digest_after"] == verdict["digest_before"]
    finally:
        if worker.poll() is None:
            worker.kill()


def test_bad_inputs_exit_1_with_one_line(tmp_path: Path) -> None:
    missing = run_cli("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert "Traceback" not in missing.stderr
    bad_hash = tmp_path / "not-a-hash"
    bad_hash.mkdir()
    refused = run_cli("restore", str(bad_hash))
    assert refused.returncode == 1
    assert "identity hash" in refused.stderr
