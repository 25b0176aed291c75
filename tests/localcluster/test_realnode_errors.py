"""Bad set-ups of the real node give one clear message, before anything is started."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError
from dynamo_snapshot_dev.localcluster.pki import Pki
from dynamo_snapshot_dev.localcluster.realnode import (
    LOCK_PATH,
    NodeComponents,
    RealNode,
    RealNodeError,
    RealNodeOptions,
    find_node_components,
)


def test_missing_binaries_are_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ComponentsMissingError) as err:
        find_node_components(tmp_path)
    msg = str(err.value)
    for name in ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "criu"):
        assert str(tmp_path / name) in msg
    assert "scripts/test-env.sh" in msg


@pytest.mark.kubelet
def test_a_second_real_node_on_the_machine_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root", pytrace=False)
    dummy = tmp_path / "none"
    node = RealNode(
        tmp_path / "node",
        server="https://127.0.0.1:1",
        pki=Pki(*([dummy] * 8)),
        admin_kubeconfig=dummy,
        kubectl=dummy,
        options=RealNodeOptions(name="second-node", bridge="dsnap-second"),
    )
    with LOCK_PATH.open("a+") as held:
        # The session's real node may hold it already; either way this one must be refused.
        with contextlib.suppress(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.truncate(0)
            held.write(str(os.getpid()))
            held.flush()
        with pytest.raises(
            RealNodeError, match=rf"a real node already runs on this machine \(pid {os.getpid()}"
        ):
            node.start()
    assert not (tmp_path / "node").exists()


def test_gpus_asked_for_on_a_machine_without_them_are_refused_before_anything_starts(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root", pytrace=False)
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    dummy = tmp_path / "none"
    node = RealNode(
        tmp_path / "node",
        server="https://127.0.0.1:1",
        pki=Pki(*([dummy] * 8)),
        admin_kubeconfig=dummy,
        kubectl=dummy,
        options=RealNodeOptions(name="gpu-node", bridge="dsnap-gpu", gpus=True),
        components=NodeComponents(*([dummy] * 6)),
    )
    with pytest.raises(
        RealNodeError, match=r"gpus=True but this machine has no NVIDIA GPU \(/dev/nvidia0 is missing\)"
    ):
        node.start()
    assert not (tmp_path / "node").exists()
    assert not Path("/sys/class/net/dsnap-gpu").exists()
