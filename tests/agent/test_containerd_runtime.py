"""The kubelet-node runtime on the real node: a container the kubelet started is checkpointed in place and
restored into another pod's own container (its namespaces, cgroup, log pipes, root filesystem).

Real kubelet, containerd, runc and CRIU; busybox containers (a shell loop plus httpd).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tarfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError, pid_running
from dynamo_snapshot.agent.runtime.containerd import CONTAINER_META, ContainerdRuntime
from dynamo_snapshot.agent.runtime.rootfs_diff import DIFF_FILE
from dynamo_snapshot.agent.weights import CarriedWeights, locate, place_weights
from dynamo_snapshot.api import protocol
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.fileio.pagecache import page_cache_fraction
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import RUNC_ROOT, TEST_IMAGE, RealNode
from tests.helpers.kubelet_stack import snapshot_pod
from tests.helpers.polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

PORT = 8080
# The source writes a token into its writable layer, deletes an image file and serves both over HTTP;
# a counter on stdout shows the process (not a new one) carries on.
# The shell holds the token open (CRIU opens it again at restore); /www/later it does not hold.
SOURCE_SCRIPT = (
    "echo token-$$-$(date +%s%N) > /www/token; exec 3< /www/token; echo later > /www/later; "
    "rm /www/index.html; httpd -p 8080 -h /www; "
    "i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done"
)


def _pod(node: RealNode, name: str, command: list[str], *, standby: bool = False) -> dict[str, Any]:
    main = {"image": TEST_IMAGE.name, "command": command, "resources": {"limits": {"memory": "64Mi"}}}
    return snapshot_pod(node, name, main, standby=standby)


def _run(cluster: LocalCluster, ns: str, manifest: dict[str, Any]) -> dict[str, Any]:
    cluster.apply(manifest, namespace=ns)
    name = manifest["metadata"]["name"]
    cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", f"pod/{name}", "--timeout=90s", timeout=100)
    pod: dict[str, Any] = json.loads(cluster.kubectl("get", "-n", ns, "pod", name, "-o", "json").stdout)
    return pod


def _status(pod: dict[str, Any]) -> tuple[str, str]:
    st = pod["status"]["containerStatuses"][0]
    return str(st["containerID"]), str(st.get("imageID") or "")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _http_code(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def runtime(tmp_path: Path, criu_bin: Path) -> ContainerdRuntime:
    return ContainerdRuntime(Criu(criu_bin), tmp_path / "state", runc_root=RUNC_ROOT)


async def test_checkpoint_in_place_and_restore_into_another_pods_container(
    cluster: LocalCluster, real_node: RealNode, namespace: str, runtime: ContainerdRuntime, tmp_path: Path
) -> None:
    source = _run(cluster, namespace, _pod(real_node, "source", ["/bin/sh", "-c", SOURCE_SCRIPT]))
    src_ip = source["status"]["podIP"]
    token = _get(f"http://{src_ip}:{PORT}/token")
    cid, image_id = _status(source)
    workload = await runtime.attach("src", cid, image_id=image_id)
    assert workload.worker_control_dir == protocol.CONTROL_MOUNT_PATH
    assert f"pods/{source['metadata']['uid']}/volumes" in str(workload.control_dir)

    images = tmp_path / "images"
    images.mkdir()
    await runtime.dump(workload, images)
    meta = json.loads((images / CONTAINER_META).read_text())
    assert meta["imageID"] == image_id
    assert meta["stdio"][1].startswith("pipe:")
    assert {"/etc/hosts", protocol.CONTROL_MOUNT_PATH} <= set(meta["externalMounts"])
    # The layer's held file first, for CRIU; the file nothing holds after the count.
    with tarfile.open(images / DIFF_FILE) as tar:
        names = tar.getnames()[1:]
    early = meta["rootfsDiff"]["early"]
    assert "www/token" in names[:early]
    assert "www/later" in names[early:]
    # The source is left running for its owner to end.
    assert pid_running(workload.pid)
    assert _get(f"http://{src_ip}:{PORT}/token") == token

    target = _run(cluster, namespace, _pod(real_node, "target", ["/bin/sleep", "100000"], standby=True))
    dst_ip = target["status"]["podIP"]
    assert dst_ip != src_ip
    tcid, _ = _status(target)
    await runtime.attach("dst", tcid)
    restored = await runtime.restore("dst", images, None)
    assert restored.pid != workload.pid
    assert pid_running(restored.pid)
    beside = await runtime.finish_restore("dst")
    assert beside is not None
    assert beside >= 0
    assert await runtime.finish_restore("dst") is None

    # The restored tree answers on the target pod's IP, with the source's writable layer (the token it
    # wrote, the file it deleted).
    assert _get(f"http://{dst_ip}:{PORT}/token") == token
    assert _http_code(f"http://{dst_ip}:{PORT}/index.html") == 404
    assert _get(f"http://{dst_ip}:{PORT}/later") == "later\n"
    # It lives in the target container's cgroup, PID namespace and log.
    target_uid = target["metadata"]["uid"]
    cgroups = await asyncio.to_thread(Path(f"/proc/{restored.pid}/cgroup").read_text)
    assert f"pod{target_uid}/{tcid.partition('://')[2]}" in cgroups
    ps = cluster.kubectl("exec", "-n", namespace, "target", "--", "ps").stdout
    assert "httpd -p 8080" in ps
    assert "/bin/sh -c echo token" in ps

    def ticking() -> bool:
        return "tick" in cluster.kubectl("logs", "-n", namespace, "target").stdout

    wait_for(ticking, within=10, what="the restored tree's output in the target pod's log")
    hostname = cluster.kubectl("exec", "-n", namespace, "target", "--", "hostname").stdout.strip()
    assert hostname == "target"

    # Deleting the pod ends the restored tree: nothing of it is left on the host.
    cluster.kubectl("delete", "-n", namespace, "pod", "target", "--wait=true", "--timeout=60s", timeout=70)
    wait_for(lambda: not pid_running(restored.pid), within=30, what="the restored tree to end with its pod")


async def test_a_missing_runc_root_names_the_path_and_the_helm_value(tmp_path: Path, criu_bin: Path) -> None:
    runtime = ContainerdRuntime(Criu(criu_bin), tmp_path / "state", runc_root=tmp_path / "no-runc")
    with pytest.raises(WorkloadRuntimeError) as err:
        await runtime.attach("k", "containerd://" + "a" * 64)
    assert str(tmp_path / "no-runc") in str(err.value)
    assert "agent.containerRuntime.runcRoot" in str(err.value)


async def test_weights_go_into_the_restore_container_before_the_restore(
    cluster: LocalCluster, real_node: RealNode, namespace: str, runtime: ContainerdRuntime, tmp_path: Path
) -> None:
    """The restore pod's container is the restore's target before CRIU runs, so the agent copies the
    weights into its control dir beside the writable layer; the dir is on the kubelet's own mount, so the
    copy (not a link) is what the container sees, and it is in the page cache the worker loads from."""
    target = _run(cluster, namespace, _pod(real_node, "target", ["/bin/sleep", "100000"], standby=True))
    tcid, _ = _status(target)
    attached = await runtime.attach("dst", tcid)
    found = runtime.restore_target("dst")
    assert found == attached
    assert f"pods/{target['metadata']['uid']}/volumes" in str(found.control_dir)
    weights = tmp_path / "00-m.dsw"
    weights.write_bytes(os.urandom(3 << 20))
    worker_path = f"{protocol.CONTROL_MOUNT_PATH}/weights/m.dsw"
    file = locate(worker_path, protocol.CONTROL_MOUNT_PATH, found.control_dir, host_process=False)
    place_weights(weights, file, CarriedWeights(worker_path, "weights/00-m.dsw", "0" * 64, 0))
    placed = found.control_dir / "weights" / "m.dsw"
    assert placed.stat().st_ino != weights.stat().st_ino
    assert page_cache_fraction(placed) == 1.0
    seen = cluster.kubectl(
        "exec", "-n", namespace, "target", "--", "busybox", "md5sum", worker_path
    ).stdout.split()[0]
    assert seen == hashlib.md5(weights.read_bytes()).hexdigest()
    runtime.forget("dst")
    assert runtime.restore_target("dst") is None


async def test_an_unknown_container_id_is_refused(runtime: ContainerdRuntime, real_node: RealNode) -> None:
    with pytest.raises(WorkloadRuntimeError, match="not a runc container id"):
        await runtime.attach("k", "containerd://../../etc")
    with pytest.raises(WorkloadRuntimeError, match="not found"):
        await runtime.attach("k", "containerd://" + uuid.uuid4().hex * 2)


async def test_a_socket_bound_to_the_old_pod_ip_is_refused_with_a_clear_message(
    cluster: LocalCluster, real_node: RealNode, namespace: str, runtime: ContainerdRuntime, tmp_path: Path
) -> None:
    # httpd listening on the pod's own IP (from /etc/hosts), not on 0.0.0.0.
    pinned = ["/bin/sh", "-c", "exec httpd -f -p $(hostname -i):8080 -h /www"]
    source = _run(cluster, namespace, _pod(real_node, "pinned", pinned))
    cid, _ = _status(source)
    images = tmp_path / "images"
    images.mkdir()
    await runtime.dump(await runtime.attach("pinned", cid), images)

    target = _run(cluster, namespace, _pod(real_node, "elsewhere", ["/bin/sleep", "100000"], standby=True))
    tcid, _ = _status(target)
    placeholder = await runtime.attach("elsewhere", tcid)
    with pytest.raises(WorkloadRuntimeError, match="bound to its old pod IP"):
        await runtime.restore("elsewhere", images, None)
    # Nothing of the checkpoint runs in the pod, and the pod keeps its own host name.
    children = await asyncio.to_thread(
        Path(f"/proc/{placeholder.pid}/task/{placeholder.pid}/children").read_text
    )
    # (busybox sleep, the placeholder here, reaps nothing: what CRIU killed may linger as a zombie)
    assert [int(c) for c in children.split() if pid_running(int(c))] == []
    hostname = cluster.kubectl("exec", "-n", namespace, "elsewhere", "--", "hostname").stdout.strip()
    assert hostname == "elsewhere"


async def test_a_layer_that_fails_beside_the_restore_fails_it_and_stop_ends_the_tree(
    cluster: LocalCluster, real_node: RealNode, namespace: str, runtime: ContainerdRuntime, tmp_path: Path
) -> None:
    """A member of the writable layer's later part that cannot be written (a device node, added after
    the count of what CRIU needs) fails the restore when it is waited for, naming the member; the
    restored tree is then stopped and nothing of it runs in the pod."""
    source = _run(cluster, namespace, _pod(real_node, "layered", ["/bin/sh", "-c", SOURCE_SCRIPT]))
    cid, _ = _status(source)
    images = tmp_path / "images"
    images.mkdir()
    await runtime.dump(await runtime.attach("layered", cid), images)
    with tarfile.open(images / DIFF_FILE, "a") as tar:
        device = tarfile.TarInfo("www/sda")
        device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 8, 0
        tar.addfile(device)

    target = _run(cluster, namespace, _pod(real_node, "broken", ["/bin/sleep", "100000"], standby=True))
    tcid, _ = _status(target)
    placeholder = await runtime.attach("broken", tcid)
    restored = await runtime.restore("broken", images, None)
    assert pid_running(restored.pid)
    with pytest.raises(WorkloadRuntimeError, match="writable layer not applied: /www/sda: the diff holds a"):
        await runtime.finish_restore("broken")
    await runtime.stop("broken")
    wait_for(lambda: not pid_running(restored.pid), within=10, what="the restored tree to end")
    assert await runtime.find("broken") is None or not pid_running(placeholder.pid)
