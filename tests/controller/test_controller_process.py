"""`dynamo-snapshot controller` as a real process: config errors, leader election between two replicas and
graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.cli import CLI, run_cli
from tests.helpers.polling import wait_for


def test_invalid_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workers: 0\n")
    proc = run_cli("controller", "--config", str(cfg), timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "controller: invalid config: ('workers',): Input should be greater than or equal to 1"
    ]


def _holder(cluster: LocalCluster, namespace: str) -> str:
    out = cluster.kubectl(
        "get", "lease", "dynamo-snapshot-controller", "-n", namespace, "-o", "json", check=False
    )
    return str(json.loads(out.stdout)["spec"].get("holderIdentity", "")) if out.returncode == 0 else ""


@pytest.mark.cluster
def test_two_replicas_one_leader_and_handover_on_sigterm(
    cluster: LocalCluster, namespace: str, crds: list[str], tmp_path: Path
) -> None:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    args = [*CLI, "controller", "--namespace", namespace, "--lease-namespace", namespace]
    args += ["--metrics-port", "0"]
    logs = [(tmp_path / f"c{i}.log").open("w") for i in range(2)]
    procs = [subprocess.Popen(args, env=env, stdout=logs[i], stderr=logs[i]) for i in range(2)]
    try:
        wait_for(lambda: _holder(cluster, namespace) != "", what="a leader")
        first = _holder(cluster, namespace)
        time.sleep(3)
        assert _holder(cluster, namespace) == first, "leadership must be stable while the leader is healthy"
        led = [p for p in procs if _leads(tmp_path, procs.index(p))]
        assert len(led) == 1, "exactly one replica syncs caches and reconciles"
        leader = led[0]
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=30) == 0, "SIGTERM drains and exits cleanly"
        # The leader releases the Lease on the way out, so the other takes over without waiting it out.
        wait_for(lambda: _holder(cluster, namespace) not in ("", first), 20, "the other replica to lead")
        follower = next(p for p in procs if p is not leader)
        wait_for(lambda: _leads(tmp_path, procs.index(follower)), 20, "the new leader to sync its caches")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _leads(tmp_path: Path, i: int) -> bool:
    return "caches synced" in (tmp_path / f"c{i}.log").read_text()
