"""The GPU device plugin and the CDI spec on the real kubelet and containerd, with a fake GPU: its device
node a character device made here (/dev/null's numbers), its driver library a file written here. The node
advertises `nvidia.com/gpu: 1`; a pod that asks for one, nothing privileged, gets the device node, the
library mounted read-only and the environment, put there by containerd from the CDI names the plugin's
Allocate answered with; a second pod stays Pending; the plugin registers again when the kubelet restarts
and reports the GPU unhealthy while its device node is gone."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot_dev.localcluster.cluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import TEST_IMAGE, RealNode
from dynamo_snapshot_dev.localcluster.realnode.cdi import (
    Gpu,
    GpuFacts,
    naming_a_missing_device_node,
    read_device_nodes,
    replace_spec_file,
    write_cdi_spec,
)
from dynamo_snapshot_dev.localcluster.supervise import Proc, spawn_logged, terminate

pytestmark = pytest.mark.kubelet

FAKE_UUID = "GPU-00000000-0000-0000-0000-00000000f00d"
FAKE_ROOT = Path("/run/dsnap-fake-gpu")
LIBCUDA_TEXT = "not a driver: the fake GPU's libcuda\n"
NODES = ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


@dataclass
class FakeGpu:
    node: RealNode
    dev: Path
    libcuda: Path
    spec: Path
    plugin: Proc


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)


def _allocatable_gpus(node: RealNode) -> str | None:
    obj = json.loads(node.kubectl("get", "node", node.name, "-o", "json").stdout)
    value: str | None = obj["status"].get("allocatable", {}).get("nvidia.com/gpu")
    return value


def _mknod_like_dev_null(path: Path) -> None:
    null = os.stat("/dev/null").st_rdev
    os.mknod(path, stat.S_IFCHR | 0o666, null)


@pytest.fixture
def fake_gpu(real_node: RealNode, request: pytest.FixtureRequest) -> Iterator[FakeGpu]:
    """The fake GPU advertised by the plugin, ``request.param`` times (time-slicing replicas; 1 unless a
    test parametrizes it indirectly)."""
    replicas: int = getattr(request, "param", 1)
    plugin_bin = real_node.components.gpu_device_plugin
    assert plugin_bin is not None, f"no gpu-device-plugin in {real_node.components.bin_dir}"
    shutil.rmtree(FAKE_ROOT, ignore_errors=True)
    dev, lib = FAKE_ROOT / "dev", FAKE_ROOT / "lib"
    dev.mkdir(parents=True)
    lib.mkdir()
    for name in NODES:
        _mknod_like_dev_null(dev / name)
    libcuda = lib / "libcuda.so.1"
    libcuda.write_text(LIBCUDA_TEXT)
    facts = GpuFacts(
        gpus=[Gpu(index=0, uuid=FAKE_UUID, name="Fake GPU", minor=0)],
        dev_dir=dev,
        device_nodes=read_device_nodes(dev),
        libraries=[libcuda],
    )
    spec = write_cdi_spec(real_node.cdi_dir, facts)
    argv = [
        str(plugin_bin),
        f"--cdi-spec-dir={real_node.cdi_dir}",
        "--socket=dsnap-fake-gpu.sock",
        "--health-interval=500ms",
        f"--replicas={replicas}",
    ]
    plugin = spawn_logged(real_node.workdir / "logs", "fake-gpu-device-plugin", argv)
    try:
        _wait(
            f"nvidia.com/gpu: {replicas} on the node", lambda: _allocatable_gpus(real_node) == str(replicas)
        )
        yield FakeGpu(real_node, dev, libcuda, spec, plugin)
    finally:
        terminate(plugin.popen, 10, 5)
        plugin.log_handle.close()
        spec.unlink(missing_ok=True)
        shutil.rmtree(FAKE_ROOT, ignore_errors=True)


def _gpu_pod(node: RealNode, name: str, script: str) -> dict[str, Any]:
    """A pod that asks for one GPU through the scheduler (no nodeName: a pod that cannot get one stays
    Pending), with the container's default, unprivileged security context."""
    overrides = node.pod_overrides()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": overrides["tolerations"],
            "dnsPolicy": overrides["dnsPolicy"],
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "cuda",
                    "image": TEST_IMAGE.name,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def _pod(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = json.loads(
        cluster.kubectl("get", "-n", namespace, "pod", name, "-o", "json").stdout
    )
    return pod


def _logs(cluster: LocalCluster, namespace: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, name).stdout


INSPECT = (
    f"stat -c '%F %t:%T' /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; "
    f"cat {FAKE_ROOT}/lib/libcuda.so.1; "
    'echo "VISIBLE=$NVIDIA_VISIBLE_DEVICES"; echo "LDPATH=$LD_LIBRARY_PATH"; '
    f"(echo x >> {FAKE_ROOT}/lib/libcuda.so.1) 2>/dev/null && echo WRITABLE || echo READ-ONLY; "
    "echo DONE; exec sleep 3600"
)


def _run_and_inspect(cluster: LocalCluster, node: RealNode, namespace: str, name: str) -> str:
    cluster.apply(_gpu_pod(node, name, INSPECT), namespace=namespace)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", f"pod/{name}", "--timeout=90s", timeout=100
    )
    _wait(f"{name}'s report", lambda: "DONE" in _logs(cluster, namespace, name), 30)
    return _logs(cluster, namespace, name)


def _check_report(report: str, node_null: str) -> None:
    lines = report.splitlines()
    assert lines[:4] == [f"character special file {node_null}"] * 4, report
    assert LIBCUDA_TEXT.strip() in lines, report
    assert f"VISIBLE={FAKE_UUID}" in lines, report
    assert f"LDPATH={FAKE_ROOT / 'lib'}" in lines, report
    assert "READ-ONLY" in lines, report


def test_a_pod_asking_for_a_gpu_gets_it_through_the_plugin_and_cdi(
    cluster: LocalCluster, fake_gpu: FakeGpu, namespace: str
) -> None:
    null = os.stat("/dev/null").st_rdev
    node_null = f"{os.major(null):x}:{os.minor(null):x}"
    node = fake_gpu.node
    report = _run_and_inspect(cluster, node, namespace, "gpu-one")
    _check_report(report, node_null)
    spec = _pod(cluster, namespace, "gpu-one")["spec"]["containers"][0]
    assert "securityContext" not in spec, "nothing privileged in the pod"

    # The one GPU is taken: another pod that asks for one is not scheduled.
    cluster.apply(_gpu_pod(node, "gpu-two", "exec sleep 3600"), namespace=namespace)

    def unschedulable() -> bool:
        conds = _pod(cluster, namespace, "gpu-two")["status"].get("conditions", [])
        return any(
            c["type"] == "PodScheduled"
            and c["status"] == "False"
            and "nvidia.com/gpu" in c.get("message", "")
            for c in conds
        )

    _wait("gpu-two unschedulable for want of nvidia.com/gpu", unschedulable, 30)
    time.sleep(3)
    assert _pod(cluster, namespace, "gpu-two")["status"]["phase"] == "Pending"

    # A restarted kubelet removes the plugin's socket; the plugin serves and registers again, and the GPU
    # freed by the first pod goes to the second.
    node.restart_kubelet()
    _wait("the plugin registered again", lambda: _allocatable_gpus(node) == "1", 60)
    cluster.kubectl("delete", "-n", namespace, "pod", "gpu-one", "--wait=true", timeout=60)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", "pod/gpu-two", "--timeout=90s", timeout=100
    )
    cluster.kubectl("delete", "-n", namespace, "pod", "gpu-two", "--wait=true", timeout=60)
    _check_report(_run_and_inspect(cluster, node, namespace, "gpu-three"), node_null)


def test_a_gpu_whose_device_node_is_gone_is_unhealthy(fake_gpu: FakeGpu) -> None:
    (fake_gpu.dev / "nvidia0").unlink()
    _wait("nvidia.com/gpu: 0 once /dev/nvidia0 is gone", lambda: _allocatable_gpus(fake_gpu.node) == "0", 30)
    _mknod_like_dev_null(fake_gpu.dev / "nvidia0")
    _wait("nvidia.com/gpu: 1 once it is back", lambda: _allocatable_gpus(fake_gpu.node) == "1", 30)
    log = fake_gpu.plugin.log.read_text()
    assert (
        f"{FAKE_UUID} (nvidia.com/gpu={FAKE_UUID}) is unhealthy: device node {fake_gpu.dev / 'nvidia0'}"
        in log
    )


def test_a_spec_naming_a_missing_device_node_keeps_new_gpu_pods_pending_until_it_is_fixed(
    cluster: LocalCluster, fake_gpu: FakeGpu, namespace: str
) -> None:
    good = json.loads(fake_gpu.spec.read_text())
    missing = fake_gpu.dev / "nvidia7"
    replace_spec_file(fake_gpu.spec, naming_a_missing_device_node(good, FAKE_UUID, missing))
    _wait(
        "nvidia.com/gpu: 0 while the spec names a missing node",
        lambda: _allocatable_gpus(fake_gpu.node) == "0",
        30,
    )
    assert f"{FAKE_UUID} (nvidia.com/gpu={FAKE_UUID}) is unhealthy: device node {missing}" in (
        fake_gpu.plugin.log.read_text()
    )
    cluster.apply(_gpu_pod(fake_gpu.node, "after-bad-spec", "echo RAN; exec sleep 3600"), namespace=namespace)

    def unschedulable() -> bool:
        cond = next(
            (
                c
                for c in _pod(cluster, namespace, "after-bad-spec")["status"].get("conditions") or []
                if c["type"] == "PodScheduled"
            ),
            {},
        )
        return cond.get("reason") == "Unschedulable" and "nvidia.com/gpu" in cond.get("message", "")

    _wait("the pod unschedulable for want of nvidia.com/gpu", unschedulable, 30)
    pod = _pod(cluster, namespace, "after-bad-spec")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName"), "no node, so no container was made"
    replace_spec_file(fake_gpu.spec, good)
    _wait("nvidia.com/gpu: 1 once the spec is fixed", lambda: _allocatable_gpus(fake_gpu.node) == "1", 30)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", "pod/after-bad-spec", "--timeout=120s", timeout=130
    )
    _wait("the pod's own output", lambda: "RAN" in _logs(cluster, namespace, "after-bad-spec"), 30)


@pytest.mark.parametrize("fake_gpu", [2], indirect=True)
def test_time_slicing_gives_one_gpu_to_as_many_pods_as_it_has_replicas(
    cluster: LocalCluster, fake_gpu: FakeGpu, namespace: str
) -> None:
    null = os.stat("/dev/null").st_rdev
    node_null = f"{os.major(null):x}:{os.minor(null):x}"
    node = fake_gpu.node
    for name in ("share-one", "share-two"):
        # Each replica hands out the same GPU: the same device nodes, library and UUID.
        _check_report(_run_and_inspect(cluster, node, namespace, name), node_null)
    cluster.apply(_gpu_pod(node, "share-three", "exec sleep 3600"), namespace=namespace)
    time.sleep(3)
    assert _pod(cluster, namespace, "share-three")["status"]["phase"] == "Pending"
