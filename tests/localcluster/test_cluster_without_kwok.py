"""The control plane on a machine that has neither kwok nor helm (the GPU machine carries only etcd, the
Kubernetes components, kubectl and CRIU): it starts without fake nodes and says so; what needs the missing
pieces refuses with their name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster, LocalClusterError
from dynamo_snapshot_dev.localcluster.chart_install import helm
from dynamo_snapshot_dev.localcluster.components import (
    CACHE_ENV,
    ComponentsMissingError,
    cache_dir,
    find_components,
)

CONTROL_PLANE = ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "criu"]


def _fake_bin(directory: Path, names: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(0o755)
    return directory


def test_kwok_and_helm_are_optional_only_where_asked(tmp_path: Path) -> None:
    base = _fake_bin(tmp_path, CONTROL_PLANE)
    comps = find_components(base, kwok=False, helm=False)
    assert (comps.kwok, comps.helm, comps.kwok_stages) == (None, None, None)
    assert comps.kubectl == base / "kubectl"
    with pytest.raises(ComponentsMissingError, match=r": kwok, helm, kwok-stages.yaml — "):
        find_components(base)


def test_optional_ones_present_are_taken_and_kwok_needs_its_stages(tmp_path: Path) -> None:
    base = _fake_bin(tmp_path, [*CONTROL_PLANE, "kwok", "helm"])
    with pytest.raises(ComponentsMissingError, match=r": kwok-stages.yaml — "):
        find_components(base, kwok=False, helm=False)
    (base / "kwok-stages.yaml").write_text("{}\n")
    comps = find_components(base, kwok=False, helm=False)
    assert (comps.kwok, comps.helm, comps.kwok_stages) == (
        base / "kwok",
        base / "helm",
        base / "kwok-stages.yaml",
    )


@pytest.mark.cluster
def test_the_control_plane_starts_without_kwok_and_helm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = cache_dir() / "bin"
    missing = [n for n in CONTROL_PLANE if not os.access(cached / n, os.X_OK)]
    if missing:
        pytest.fail(f"missing in {cached}: {', '.join(missing)}: run scripts/test-env.sh", pytrace=False)
    # A cache whose bin dir holds only what the GPU machine has, linked to the real binaries.
    bin_dir = tmp_path / "cache" / "bin"
    bin_dir.mkdir(parents=True)
    for name in CONTROL_PLANE:
        (bin_dir / name).symlink_to(cached / name)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    said: list[str] = []
    cluster = LocalCluster(tmp_path / "cluster")
    try:
        cluster.start(progress=said.append)
        assert f"no kwok in {bin_dir}: the cluster runs without fake nodes" in said
        assert set(cluster.alive()) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
        assert all(cluster.alive().values())
        assert cluster.kubectl("get", "--raw=/readyz").stdout == "ok"
        with pytest.raises(LocalClusterError, match=r"fake GPU node g: this cluster runs without kwok"):
            cluster.add_gpu_node("g")
        with pytest.raises(ComponentsMissingError, match=rf"missing in {bin_dir}: helm"):
            helm(cluster, "version")
    finally:
        cluster.stop()
    assert cluster.alive() == {}
