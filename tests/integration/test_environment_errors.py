"""A bad environment stops with one line that says what to do, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster, LocalClusterError
from dynamo_snapshot_dev.localcluster.cluster import ClusterOptions, ensure_port_free
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError, find_components
from tests.helpers.cli import run_demo

REPO = Path(__file__).resolve().parents[2]


def test_missing_binaries_name_each_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    (tmp_path / "etcd").chmod(0o755)
    with pytest.raises(ComponentsMissingError) as err:
        find_components(tmp_path)
    msg = str(err.value)
    assert "kube-apiserver" in msg
    assert "kwok" in msg
    assert "etcd," not in msg
    assert "scripts/test-env.sh" in msg
    assert "\n" not in msg


def test_port_in_use_is_named() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(LocalClusterError, match=rf"port {port} for kube-apiserver is in use"):
            ensure_port_free(port, "kube-apiserver")


@pytest.mark.cluster
def test_cluster_refuses_a_busy_apiserver_port(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        lc = LocalCluster(tmp_path, options=ClusterOptions(apiserver_port=port))
        with pytest.raises(LocalClusterError, match="is in use"):
            lc.start()
        assert lc.alive() == {}, "nothing may be left running after a refused start"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_setup_script_refuses_non_root_in_one_line() -> None:
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "scripts/test-env.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": "/tmp"},
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "test-env: must run as root (CRIU, apt and the fake GPU nodes need it): re-run with sudo"
    ]


def test_demo_reports_missing_components_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "DYNSNAP_CACHE": str(tmp_path / "empty-cache"), "COLUMNS": "300"}
    proc = run_demo("--setup-only", "--workdir", str(tmp_path / "w"), timeout=60, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "demo failed: missing in" in proc.stderr
    assert "scripts/test-env.sh" in proc.stderr


@pytest.mark.cluster
def test_demo_brings_up_cluster_with_crds_and_gpu_nodes(tmp_path: Path) -> None:
    proc = run_demo(
        "--setup-only",
        "--kwok",
        "--gpu-nodes",
        "1",
        "--workdir",
        str(tmp_path),
        timeout=240,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ready" in proc.stderr
    assert "1 fake H200 nodes" in proc.stderr
    assert "CRDs installed" in proc.stderr
