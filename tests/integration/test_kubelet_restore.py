"""Auto mode on the real kubelet node, end to end: the controller and the node agent (runtime containerd)
in-process, the CPU reference worker in kubelet pods from the locally built worker image.

The first worker cold-starts, the checkpoint is taken from the kubelet-run checkpoint pod, then the
graph scales by restore: each restore pod's own container is the restored worker, answering on its own
pod IP and through a Service with the cold worker's output, under its pod's memory limit and gone with
its pod.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.runtime.base import pid_running
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactStore, artifact_key
from dynamo_snapshot.kube import EVENT, POD, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT_CONTENT
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.realnode import RUNC_ROOT, TEST_IMAGE, RealNode
from tests.helpers.kubelet_stack import (
    GRAPH,
    MEMORY_LIMIT_BYTES,
    PORT,
    PROMPT,
    SERVICE,
    Stack,
    captured_worker,
    checkpointed_graph,
    eventually,
    first_answer,
    health,
    pods,
    post,
    ready,
    restore_pod,
    snapshot_pod,
    workers_outside_pods,
)
from tests.helpers.polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]


def _restored_pid(pod: Obj) -> int:
    container_id = pod["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    placeholder = json.loads((RUNC_ROOT / container_id / "state.json").read_text())["init_process_pid"]
    children = Path(f"/proc/{placeholder}/task/{placeholder}/children").read_text().split()
    assert children, f"no restored process under the placeholder {placeholder} of {pod['metadata']['name']}"
    return int(children[0])


def _memory_cgroup(pod: Obj) -> Path:
    container_id = pod["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    found = list(Path("/sys/fs/cgroup/memory/kubepods").rglob(container_id))
    assert len(found) == 1, found
    return found[0]


def _restore_status(pod: Obj) -> str | None:
    ann = pod["metadata"].get("annotations") or {}
    return ann.get(protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main"))


async def _restored_ready(s: Stack, count: int, *, failures_allowed: bool = False) -> list[Obj]:
    async def all_ready() -> list[Obj]:
        restoring = await pods(s, protocol.StartMode.RESTORE.value)
        if not failures_allowed:
            for p in restoring:
                assert _restore_status(p) != "failed", p["metadata"]["annotations"]
        done = [p for p in restoring if ready(p)]
        return done if len(done) == count else []

    found: list[Obj] = await eventually(all_ready, 180, f"{count} restore pods to be Ready")
    return found


async def test_auto_mode_on_the_kubelet_node(
    stack: Stack, cluster: LocalCluster, real_node: RealNode
) -> None:
    s = stack
    s.start_agent()
    ckpt, cold = await checkpointed_graph(s)
    assert ckpt["status"]["sourcePod"].startswith(f"{ckpt['metadata']['name']}-checkpoint-")
    expected = await asyncio.to_thread(post, cold["status"]["podIP"])

    await DgdClient(s.kube).set_replicas(GRAPH, s.namespace, SERVICE, 4)
    restored = await _restored_ready(s, 3)
    ips = {p["status"]["podIP"] for p in restored}
    assert len(ips) == 3
    assert cold["status"]["podIP"] not in ips
    for pod in restored:
        name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
        answer = await asyncio.to_thread(post, ip)
        # The cold worker's output (its weights and compiled kernel came back with the process), under
        # the restore pod's own name (the identity the agent handed it).
        assert answer == {**expected, "pod": name}
        assert (await asyncio.to_thread(health, ip))["pod"] == name
        ps = cluster.kubectl("exec", "-n", s.namespace, name, "--", "ps", "-o", "pid,args").stdout
        workers = [line.split(None, 1) for line in ps.splitlines() if "cpu_worker.py" in line]
        # The standby placeholder (the container's first process) and the restored worker under it.
        assert len(workers) == 2, ps
        assert workers[0][0] == "1", ps

    # Through a Service (kube-proxy on the node).
    labels = restored[0]["metadata"]["labels"]
    selector = {protocol.LABEL_GRAPH: labels[protocol.LABEL_GRAPH], protocol.LABEL_START_MODE: "restore"}
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "restored"},
            "spec": {"selector": selector, "ports": [{"port": 80, "targetPort": PORT}]},
        },
        namespace=s.namespace,
    )
    svc = json.loads(cluster.kubectl("get", "-n", s.namespace, "service", "restored", "-o", "json").stdout)
    cluster_ip = svc["spec"]["clusterIP"]

    def via_service() -> dict[str, Any]:
        req = urllib.request.Request(f"http://{cluster_ip}:80/generate", data=PROMPT, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return answer
        except OSError:
            return {}

    answer = wait_for(via_service, within=30, what=f"service {cluster_ip}:80 to answer")
    assert answer["text"] == expected["text"]
    assert answer["pod"] in {p["metadata"]["name"] for p in restored}

    # The pod's memory limit holds the restored worker: it is charged to the container's cgroup, whose
    # limit is the pod's, and going past it kills inside the container, not on the host.
    target = restored[0]
    pid = await asyncio.to_thread(_restored_pid, target)
    cgroup = await asyncio.to_thread(_memory_cgroup, target)
    procs = (cgroup / "cgroup.procs").read_text().split()
    assert str(pid) in procs
    assert int((cgroup / "memory.limit_in_bytes").read_text()) == MEMORY_LIMIT_BYTES
    assert int((cgroup / "memory.usage_in_bytes").read_text()) >= 24 << 20
    hog = cluster.kubectl(
        "exec", "-n", s.namespace, target["metadata"]["name"], "--",
        "python3", "-c", "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])",
        check=False, timeout=60,
    )  # fmt: skip
    assert hog.returncode != 0, hog
    oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
    assert int(oom.get("oom_kill", "0")) >= 1, oom

    # Deleting a restore pod leaves no process of it on the host.
    victim = restored[1]
    victim_pid = await asyncio.to_thread(_restored_pid, victim)
    assert pid_running(victim_pid)
    cluster.kubectl(
        "delete",
        "-n",
        s.namespace,
        "pod",
        victim["metadata"]["name"],
        "--wait=true",
        "--timeout=60s",
        timeout=70,
    )
    wait_for(lambda: not pid_running(victim_pid), within=30, what="the deleted pod's restored worker to end")
    assert workers_outside_pods() == []


async def test_agent_killed_mid_restore_then_kubelet_restarted(
    stack: Stack, cluster: LocalCluster, real_node: RealNode
) -> None:
    s = stack
    runtime = s.start_agent()
    _, cold = await checkpointed_graph(s)
    expected = await asyncio.to_thread(post, cold["status"]["podIP"])

    # The agent dies after CRIU brought the tree back into the restore pod, before it told the worker so.
    restored_tree = asyncio.Event()
    real_restore = runtime.restore

    async def restore_then_hang(*args: Any, **kwargs: Any) -> Any:
        await real_restore(*args, **kwargs)
        restored_tree.set()
        await asyncio.Event().wait()

    runtime.restore = restore_then_hang  # type: ignore[method-assign]
    await DgdClient(s.kube).set_replicas(GRAPH, s.namespace, SERVICE, 2)
    await asyncio.wait_for(restored_tree.wait(), 120)
    await s.kill_agent()
    assert workers_outside_pods() == []

    # A new agent process clears the half-done restore and ends with a serving restore pod (a restore
    # into the container the kubelet started anew, or a replacement pod).
    s.start_agent()
    (pod,) = await _restored_ready(s, 1, failures_allowed=True)
    answer = await asyncio.to_thread(post, pod["status"]["podIP"])
    assert answer == {**expected, "pod": pod["metadata"]["name"]}
    assert workers_outside_pods() == []

    # A kubelet restart leaves the restored worker running, Ready and serving.
    pid = await asyncio.to_thread(_restored_pid, pod)
    await asyncio.to_thread(real_node.restart_kubelet)
    await asyncio.sleep(3)
    assert pid_running(pid)
    (again,) = await _restored_ready(s, 1)
    assert again["metadata"]["uid"] == pod["metadata"]["uid"]
    assert await asyncio.to_thread(_restored_pid, again) == pid
    answer = await asyncio.to_thread(post, again["status"]["podIP"])
    assert answer == {**expected, "pod": pod["metadata"]["name"]}


async def _verdict(s: Stack, name: str) -> tuple[str, str]:
    """The agent's failed verdict on pod ``name``: its message and the reason of its Warning Event."""

    async def failed() -> str | None:
        pod = await s.kube.get(POD, name, s.namespace)
        ann = pod["metadata"].get("annotations") or {}
        if _restore_status(pod) == "failed":
            return str(ann[protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")])
        return None

    message: str = await eventually(failed, 60, f"the agent's verdict on {name}")

    async def event() -> str | None:
        events, _ = await s.kube.list_all(EVENT, s.namespace)
        for e in events:
            if e["involvedObject"].get("name") == name and e.get("type") == "Warning":
                assert e["message"] == message
                return str(e["reason"])
        return None

    reason: str = await eventually(event, 30, f"a Warning Event on {name}")
    return message, reason


async def test_bad_restores_are_refused_with_a_clear_message(
    stack: Stack, cluster: LocalCluster, real_node: RealNode
) -> None:
    s = stack
    s.start_agent(standby_timeout_seconds=4)
    ckpt, _ = await checkpointed_graph(s)
    dgd = await DgdClient(s.kube).get(GRAPH, s.namespace)
    worker, busybox = real_node.worker_image.name, TEST_IMAGE.name
    sentinel = f"{protocol.CONTROL_MOUNT_PATH}/{protocol.FILE_RESTORE_STANDBY}"
    cases = {
        # Started without standby: its entrypoint may have cold-started the worker.
        "no-standby": (worker, None, False, "RestoreRefused", "is not in standby: it runs without"),
        # Told to stand by, but its entrypoint never says it does, and it is no inert placeholder (a
        # shell with a child; `sleep` alone would be one).
        "silent": (
            busybox,
            ["sh", "-c", "sleep 3600; exit 0"],
            True,
            "RestoreRefused",
            "no restore-standby or restore-context.json in its control dir",
        ),
        # A placeholder of another image: the checkpointed tree expects the worker image underneath.
        "other-image": (
            busybox,
            ["sh", "-c", f"echo {{}} > {sentinel}; exec sleep 3600"],
            True,
            "RestoreIncompatible",
            "image differs: the checkpoint was taken from image",
        ),
    }
    for name, (image, command, standby, _, _) in cases.items():
        await s.kube.create(POD, restore_pod(s, name, dgd, ckpt, image, command, standby=standby))
    for name, (_, _, _, reason, text) in cases.items():
        message, got = await _verdict(s, name)
        assert got == reason, (name, message)
        assert text in message, (name, message)
    # Both images by digest, as the kubelet reports them.
    placeholder = await s.kube.get(POD, "other-image", s.namespace)
    message, _ = await _verdict(s, "other-image")
    assert placeholder["status"]["containerStatuses"][0]["imageID"] in message
    cold = (await pods(s, protocol.StartMode.COLD.value))[0]
    assert cold["status"]["containerStatuses"][0]["imageID"] in message
    assert workers_outside_pods() == []

    # A writable-layer diff that no longer matches its checksum is refused before anything runs.
    diff = next(s.store.rglob("criu/rootfs-diff.tar"))
    data = bytearray(diff.read_bytes())
    data[len(data) // 2] ^= 0xFF
    diff.write_bytes(bytes(data))
    await s.kube.create(POD, restore_pod(s, "corrupt", dgd, ckpt, worker, None, standby=True))
    message, reason = await _verdict(s, "corrupt")
    assert reason == "RestoreFailed"
    assert "rootfs-diff.tar" in message
    assert "refused" in message
    # The contract's restore-failed, in the container's control dir: a later container of the pod reads
    # that the pod's restore was used (this SDK's standby then exits instead of waiting).
    failed = f"{protocol.CONTROL_MOUNT_PATH}/{protocol.FILE_RESTORE_FAILED}"
    said = cluster.kubectl("exec", "-n", s.namespace, "corrupt", "--", "cat", failed).stdout
    assert json.loads(said)["message"] == message

    # An agent that cannot reach the container runtime's state names the path and the Helm value.
    await s.kill_agent()
    s.start_agent(runc_root=s.state / "no-runc-root")
    await s.kube.create(POD, restore_pod(s, "no-runtime", dgd, ckpt, worker, None, standby=True))
    message, reason = await _verdict(s, "no-runtime")
    assert reason == "RestoreFailed"
    assert str(s.state / "no-runc-root") in message
    assert "agent.containerRuntime.runcRoot" in message


async def test_a_podsnapshot_of_a_kubelet_pod_is_captured_and_restored_by_restore_from(
    stack: Stack, real_node: RealNode
) -> None:
    """NVIDIA Snapshot's generic API on the real node: a PodSnapshot of a running kubelet pod is bound by
    the controller, captured in place by the node's agent from the kubelet's container, and Ready with the
    artifact the content names, bound to that pod. A plain standby pod annotated nvidia.com/restore-from
    with its name is then restored into its own container and serves on its own pod IP."""
    s = stack
    s.start_agent()
    created, snapshot = await captured_worker(s, "snap-source")
    content = await s.kube.get(POD_SNAPSHOT_CONTENT, snapshot["status"]["boundSnapshotContentName"])
    stored = ArtifactStore(s.store).open(artifact_key(s.namespace, snapshot["metadata"]["uid"]))
    assert content["status"]["artifact"]["digest"] == stored.manifest.digest
    assert content["status"]["artifact"]["location"] == str(stored.path)
    assert stored.manifest.binding is not None
    assert stored.manifest.binding.source_pod_uid == created["metadata"]["uid"]
    assert content["status"]["compatibility"]["imageId"]  # the kubelet's imageID of the captured container

    restored = snapshot_pod(real_node, "snap-restored", {"image": real_node.worker_image.name}, standby=True)
    restored["metadata"].update(namespace=s.namespace, annotations={protocol.ANNOTATION_RESTORE_FROM: "snap"})
    await s.kube.create(POD, restored)

    async def restore_done() -> Obj | None:
        pod = await s.kube.get(POD, "snap-restored", s.namespace)
        state = _restore_status(pod)
        assert state != "failed", pod["metadata"].get("annotations")
        return pod if state == "completed" and pod["status"].get("podIP") else None

    pod = await eventually(restore_done, 180, "the restore-from pod to be restored")

    assert await first_answer(pod["status"]["podIP"])
