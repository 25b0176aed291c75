"""The Helm chart installed as users install it, on the real kubelet node: the controller and agent images
built here (localcluster/project_images.py) imported into the node's containerd, `helm install -f
values-local.yaml`, and the Auto-mode story run by the controller *pod* and the agent *pod* alone: cold
start, checkpoint, 3 restores, a lost worker replaced by restore, scale-down; then `helm upgrade` with a
changed value and `helm uninstall`, as docs/install.md describes them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dynamo_snapshot.agent.privileges import CONTAINERD_DEFAULT_CAPABILITIES, REQUIRED_CAPABILITIES
from dynamo_snapshot.api import protocol
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.chart_install import CHART, helm, install, node_values
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from dynamo_snapshot_dev.localcluster.realnode.host import host_processes
from tests.helm.conftest import without_dgd_crd  # noqa: F401  (a fixture)
from tests.helpers.kubelet_stack import (
    GRAPH,
    SERVICE,
    graph_manifest,
    health,
    post,
    ready,
    worker_processes,
    workers_outside_pods,
)
from tests.helpers.polling import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.criu, pytest.mark.kubelet]

GPU_LABEL = "nvidia.com/gpu.present"
DGD_V1ALPHA1 = f"dynamographdeployments.{protocol.API_VERSION}.{protocol.API_GROUP}"
DGD_V1BETA1 = f"dynamographdeployments.{protocol.API_VERSION_V1BETA1}.{protocol.API_GROUP}"


@pytest.fixture
def store() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="chart-store-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gpu_labelled(real_node: RealNode, cluster: LocalCluster) -> Iterator[None]:
    """The label the GPU operator puts on GPU nodes, which the chart's agent selects by default."""
    cluster.kubectl("label", "node", real_node.name, f"{GPU_LABEL}=true", "--overwrite")
    yield
    cluster.kubectl("label", "node", real_node.name, f"{GPU_LABEL}-", check=False)


def _json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def _pods(cluster: LocalCluster, namespace: str, mode: str | None = None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _json(cluster, "get", "pods", "-n", namespace)["items"]
    return [
        p
        for p in items
        if not p["metadata"].get("deletionTimestamp")
        and (mode is None or (p["metadata"].get("labels") or {}).get(protocol.LABEL_START_MODE) == mode)
    ]


def _ready_restores(cluster: LocalCluster, namespace: str, count: int) -> list[dict[str, Any]]:
    restoring = _pods(cluster, namespace, protocol.StartMode.RESTORE.value)
    for p in restoring:
        status = (p["metadata"].get("annotations") or {}).get(
            protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
        )
        assert status != "failed", p["metadata"]["annotations"]
    done = [p for p in restoring if ready(p)]
    return done if len(done) == count else []


def _release_pods(cluster: LocalCluster, namespace: str) -> dict[str, dict[str, Any]]:
    """The release's controller and agent pods, by component."""
    return {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p
        for p in _pods(cluster, namespace)
        if "app.kubernetes.io/component" in (p["metadata"].get("labels") or {})
    }


@pytest.mark.usefixtures("without_dgd_crd", "gpu_labelled")
def test_the_chart_installed_on_the_kubelet_node_runs_the_auto_mode_story(
    cluster: LocalCluster, real_node: RealNode, store: Path, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    release, system, apps = f"ds{suffix}", f"dsnap-{suffix}", f"apps-{suffix}"
    cluster.kubectl("create", "namespace", apps)
    # Only the test's namespace: the session's cluster holds other tests' objects.
    values = node_values(
        real_node,
        store,
        capabilities=[*REQUIRED_CAPABILITIES, *CONTAINERD_DEFAULT_CAPABILITIES],
        watch_namespace=apps,
    )
    chart_args = install(cluster, real_node, release, system, values, tmp_path / "node.yaml")
    try:
        _story(cluster, real_node, store, release, system, apps, chart_args)
    finally:
        helm(cluster, "uninstall", release, "-n", system, "--wait", timeout=120)
        _clear_workloads(cluster, apps)
        for ns in (system, apps):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _story(
    cluster: LocalCluster,
    node: RealNode,
    store: Path,
    release: str,
    system: str,
    apps: str,
    chart_args: list[str],
) -> None:
    def release_ready() -> dict[str, dict[str, Any]]:
        pods = _release_pods(cluster, system)
        return pods if set(pods) == {"controller", "agent"} and all(map(ready, pods.values())) else {}

    pods = wait_for(release_ready, within=120, what="the controller and agent pods to be Ready", every=1)
    assert {p["spec"]["nodeName"] for p in pods.values()} == {node.name}

    # Cold start, and the checkpoint taken by the agent pod (no other agent runs).
    manifest = graph_manifest(node, 1)
    manifest["metadata"] = {"name": GRAPH, "namespace": apps}
    cluster.apply(manifest)

    def checkpoint_ready() -> dict[str, Any]:
        for ckpt in _json(cluster, "get", "dynamocheckpoints", "-n", apps)["items"]:
            phase = (ckpt.get("status") or {}).get("phase")
            assert phase != "Failed", ckpt["status"]
            if phase == "Ready":
                return dict(ckpt)
        return {}

    ckpt = wait_for(checkpoint_ready, within=240, what="the Auto-mode checkpoint to be Ready", every=1)
    agent_log = cluster.kubectl("logs", "-n", system, pods["agent"]["metadata"]["name"], "-c", "agent").stdout
    assert '"msg": "pod snapshot captured"' in agent_log, agent_log[-3000:]
    assert ckpt["status"]["sourcePod"].startswith(f"{ckpt['metadata']['name']}-checkpoint-")
    [cold] = wait_for(
        lambda: [p for p in _pods(cluster, apps, protocol.StartMode.COLD.value) if ready(p)],
        within=60,
        what="the cold worker to be Ready",
    )
    expected = post(cold["status"]["podIP"])
    artifacts = sorted(p for p in (store / "artifacts").rglob("manifest.json"))
    assert artifacts, f"no artifact in the node-local store {store / 'artifacts'}"

    # Scale-up by restore: three restore pods, each the cold worker's process under its own name.
    scale = ["patch", DGD_V1ALPHA1, GRAPH, "-n", apps, "--type", "merge", "-p"]
    cluster.kubectl(*scale, json.dumps({"spec": {"services": {SERVICE: {"replicas": 4}}}}))
    restored = wait_for(
        lambda: _ready_restores(cluster, apps, 3), within=180, what="3 restore pods Ready", every=1
    )
    for pod in restored:
        name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
        answer = wait_for(_answering(ip), within=30, what=f"{name} to answer")
        assert answer == {**expected, "pod": name}
        # Its own host name, not the checkpoint pod's (which its /etc/hosts does not have).
        assert _host_names(pod) == {name}

    # A lost worker is replaced by restore.
    lost = restored[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", "-n", apps, lost, "--wait=true", "--timeout=60s", timeout=70)

    def replaced() -> list[dict[str, Any]]:
        now = _ready_restores(cluster, apps, 3)
        return now if lost not in {p["metadata"]["name"] for p in now} else []

    for pod in wait_for(replaced, within=180, what="the lost worker's replacement, by restore", every=1):
        assert health(pod["status"]["podIP"])["pod"] == pod["metadata"]["name"]

    # The agent pod holds the documented privileges and no more (the story above ran with them); with
    # less it refuses to start, and its pod says why.
    _refused_with_less(cluster, system, pods["agent"])

    # helm upgrade with a changed value: the agent rolls to a pod with the new config; the workers serve on.
    upgraded = helm(
        cluster, "upgrade", release, str(CHART), *chart_args, "--set", "agent.logLevel=debug", timeout=240
    )
    assert upgraded.returncode == 0, upgraded.stderr
    new_agent = _release_pods(cluster, system)["agent"]
    assert new_agent["metadata"]["uid"] != pods["agent"]["metadata"]["uid"]
    assert "debug" in new_agent["spec"]["containers"][0]["args"]
    serving = wait_for(
        lambda: _ready_restores(cluster, apps, 3), within=60, what="the 3 restored workers after the upgrade"
    )
    for pod in serving:
        assert _answer(pod["status"]["podIP"])["text"] == expected["text"]

    # Scale-down: the restored workers go with their pods.
    cluster.kubectl(*scale, json.dumps({"spec": {"services": {SERVICE: {"replicas": 1}}}}))
    wait_for(
        lambda: not _pods(cluster, apps, protocol.StartMode.RESTORE.value),
        within=60,
        what="the restore pods to go on scale-down",
    )
    wait_for(lambda: len(worker_processes()) == 1, within=30, what="one worker process left (the cold one)")
    assert workers_outside_pods() == []

    # helm uninstall: the release's pods go; the CRDs, the graph, its checkpoint and the artifact stay.
    removed = helm(cluster, "uninstall", release, "-n", system, "--wait", timeout=120)
    assert removed.returncode == 0, removed.stderr
    wait_for(lambda: not _release_pods(cluster, system), within=60, what="the release's pods to go")
    # Read at v1beta1, the version stored: `kubectl get dgd` needs no webhook (the release's is gone).
    assert _json(cluster, "get", "dgd", GRAPH, "-n", apps)["metadata"]["name"] == GRAPH
    assert _json(cluster, "get", "dynamocheckpoints", "-n", apps)["items"]
    assert sorted((store / "artifacts").rglob("manifest.json")) == artifacts
    assert workers_outside_pods() == []


def _refused_with_less(cluster: LocalCluster, namespace: str, agent: dict[str, Any]) -> None:
    container = agent["spec"]["containers"][0]
    assert "privileged" not in container["securityContext"]
    assert container["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": [*REQUIRED_CAPABILITIES, *CONTAINERD_DEFAULT_CAPABILITIES],
    }
    [owner] = agent["metadata"]["ownerReferences"]
    daemonset = ["daemonset", owner["name"], "-n", namespace]
    add = "/spec/template/spec/containers/0/securityContext/capabilities/add"
    fewer = [c for c in REQUIRED_CAPABILITIES if c != "SYS_TIME"]
    for less, says in (
        ({"op": "replace", "path": add, "value": fewer}, "CAP_SYS_TIME"),
        ({"op": "replace", "path": "/spec/template/spec/hostPID", "value": False}, "hostPID: true"),
    ):
        cluster.kubectl("patch", *daemonset, "--type", "json", "-p", json.dumps([less]))
        message = wait_for(
            lambda: _refusal(cluster, namespace, agent["metadata"]["uid"]),
            within=90,
            what=f"the agent to refuse to start without what it names ({says})",
            every=1,
        )
        assert "PrivilegeError" in message, message
        assert says in message, message
        cluster.kubectl("rollout", "undo", *daemonset)
        cluster.kubectl("rollout", "status", *daemonset, "--timeout=120s", timeout=130)


def _refusal(cluster: LocalCluster, namespace: str, old_uid: str) -> str:
    """The termination message of the agent pod that replaced ``old_uid``'s, once it has one."""
    for pod in _pods(cluster, namespace):
        labels = pod["metadata"].get("labels") or {}
        if labels.get("app.kubernetes.io/component") != "agent" or pod["metadata"]["uid"] == old_uid:
            continue
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            for state in (status.get("state") or {}, status.get("lastState") or {}):
                message = (state.get("terminated") or {}).get("message")
                if message:
                    return str(message)
    return ""


def _host_names(pod: dict[str, Any]) -> set[str]:
    """The host names of the worker processes in the pod's cgroup."""
    names = set()
    for proc in host_processes("cpu_worker.py"):
        if proc.in_pod(pod["metadata"]["uid"]):
            argv = ["nsenter", f"--uts=/proc/{proc.pid}/ns/uts", "cat", "/proc/sys/kernel/hostname"]
            names.add(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip())
    return names


def _answering(ip: str) -> Callable[[], dict[str, Any]]:
    return lambda: _answer(ip)


def _answer(ip: str) -> dict[str, Any]:
    try:
        return post(ip)
    except OSError:
        return {}


def _clear_workloads(cluster: LocalCluster, namespace: str) -> None:
    """What the docs tell users to do once the controller is gone: the checkpoints' finalizers removed
    by hand, the graph deleted (its pods go with it)."""
    cluster.kubectl("delete", DGD_V1BETA1, "--all", "-n", namespace, "--wait=false", check=False)
    for kind in ("dynamocheckpoints", "podsnapshots", "snapshotjobs"):
        items = (
            _json(cluster, "get", kind, "-n", namespace)["items"] if _has(cluster, kind, namespace) else []
        )
        for obj in items:
            cluster.kubectl(
                "patch", kind, obj["metadata"]["name"], "-n", namespace, "--type", "merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False,
            )  # fmt: skip
        cluster.kubectl("delete", kind, "--all", "-n", namespace, "--wait=false", check=False)
    wait_for(lambda: not _pods(cluster, namespace), within=90, what=f"the pods of {namespace} to go")


def _has(cluster: LocalCluster, kind: str, namespace: str) -> bool:
    return cluster.kubectl("get", kind, "-n", namespace, check=False).returncode == 0
