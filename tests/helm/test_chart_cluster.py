"""The chart against the real local apiserver: its manifests pass server-side validation, its RBAC is as
narrow as claimed (kubectl auth can-i as the service accounts), the agent's ValidatingAdmissionPolicy
holds with real pod-bound tokens, and the controller and agent run on exactly these permissions."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.cluster import free_port
from tests.helm import rbac
from tests.helm.chart import CHART, REPO, Obj, helm, one, render, render_text
from tests.helpers import dgd_crd
from tests.helpers.cli import CLI
from tests.helpers.polling import wait_for

pytestmark = pytest.mark.cluster

AUTO_DGD = REPO / "tests" / "api" / "manifests" / "dgd-vllm-snapshot-auto.yaml"
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def _release() -> str:
    # Cluster-scoped objects are named by release: unique per test, as the cluster is shared.
    return f"t{uuid.uuid4().hex[:6]}"


@dataclass
class Installed:
    """Chart objects applied for real; cluster-scoped ones are deleted by the fixture."""

    cluster: LocalCluster
    namespace: str
    release: str
    objs: list[Obj]

    def sa(self, component: str) -> str:
        return f"{self.release}-dynamo-snapshot-{component}"

    def user(self, component: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.sa(component)}"


@pytest.fixture
def install(cluster: LocalCluster, namespace: str) -> Iterator[Callable[..., Installed]]:
    applied: list[Obj] = []

    def apply(values: Obj | None = None, *, only: set[str] = RBAC_KINDS) -> Installed:
        release = _release()
        objs = [o for o in render(values, release=release, namespace=namespace) if o["kind"] in only]
        # JSON documents: every string quoted, as kubectl (YAML 1.2) must read them.
        text = "\n---\n".join(json.dumps(o) for o in objs)
        cluster.kubectl("apply", "--server-side", "-f", "-", input=text)
        applied.extend(o for o in objs if o["kind"] in CLUSTER_SCOPED)
        return Installed(cluster, namespace, release, objs)

    yield apply
    for o in applied:
        cluster.kubectl(
            "delete", o["kind"], o["metadata"]["name"], "--ignore-not-found", "--wait=false", check=False
        )


def _token(cluster: LocalCluster, namespace: str, sa: str, bound_pod: str | None = None) -> str:
    args = ["create", "token", sa, "-n", namespace, "--duration=1h"]
    if bound_pod:
        args += ["--bound-object-kind", "Pod", "--bound-object-name", bound_pod]
    return cluster.kubectl(*args).stdout.strip()


def _kubeconfig_for(cluster: LocalCluster, token: str, path: Path) -> Path:
    admin = json.loads(cluster.kubeconfig.read_text())
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": admin["clusters"],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
                "current-context": "sa",
            }
        )
    )
    return path


def _ca(cluster: LocalCluster) -> str:
    return str(json.loads(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["certificate-authority"])


def _http(url: str, context: ssl.SSLContext | None = None, **kw: Any) -> tuple[int, str]:
    req = urllib.request.Request(url, **kw)
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


# --------------------------------------------------------------------------- server-side validation


@pytest.mark.parametrize(
    "values",
    [
        None,
        {"artifacts": {"persistence": {"enabled": True, "storageClass": "rwx"}}},
        {"agent": {"runtime": "local"}, "controller": {"autoscale": False}},
        {"mode": "dynamo-operator"},
        # The bind volumes' names, paths and types, as the API server judges them.
        {
            "agent": {
                "runtime": "runc",
                "launchWorkloads": True,
                "hostBinds": ["/srv/models", "/home/dev/Checkout_v2", "/mnt/" + "x" * 80],
                "writableBinds": ["/srv/endpoints"],
            }
        },
    ],
    ids=["defaults", "pvc", "runtime-local", "dynamo-operator", "launch-with-binds"],
)
def test_rendered_manifests_pass_server_side_dry_run(
    cluster: LocalCluster, namespace: str, crds: list[str], values: Obj | None
) -> None:
    # The ServiceMonitor CRD is not installed here; its rendering is checked in test_chart.py. The
    # DynamoGraphDeployment CRD is a template (mode standalone), the others are in crds/.
    text = render_text(values, release=_release(), namespace=namespace)
    # Forced: earlier tests of the session replaced the DGD CRD (kubectl replace), whose fields a dry run
    # would otherwise report as another manager's; nothing is written either way.
    out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-", input=text
    )
    assert out.stdout.count("serverside-applied (server dry run)") == len(
        [d for d in yaml.safe_load_all(text) if d]
    ), out.stdout
    crd_out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", str(CHART / "crds")
    )
    crd_files = list((CHART / "crds").glob("*.yaml"))
    assert crd_out.stdout.count("customresourcedefinition") == len(crd_files) == 5, crd_out.stdout


def test_notes_explain_the_seccomp_profile_and_the_policy(
    cluster: LocalCluster, without_dgd_crd: None
) -> None:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    args = ["install", "notes", str(CHART), "--namespace", "snap", "--dry-run=client"]
    notes = helm(*args, env=env)
    assert notes.returncode == 0, notes.stderr
    assert "type: Localhost" in notes.stdout
    assert "localhostProfile: profiles/dynamo-snapshot-no-io-uring.json" in notes.stdout
    assert "ValidatingAdmissionPolicy notes-dynamo-snapshot-agent-pod-updates" in notes.stdout
    off = helm(*args, "--set", "agent.admissionPolicy.enabled=false", env=env)
    assert "WARNING: agent.admissionPolicy.enabled is false" in off.stdout


# --------------------------------------------------------------------------- RBAC


def _can(cluster: LocalCluster, user: str, namespace: str, verb: str, resource: str, *extra: str) -> bool:
    out = cluster.kubectl(
        "auth", "can-i", verb, resource, f"--as={user}", "-n", namespace, *extra, check=False
    )
    answer = out.stdout.strip()
    assert answer in ("yes", "no"), f"can-i {verb} {resource}: {out.stdout} {out.stderr}"
    return answer == "yes"


def test_rbac_is_as_narrow_as_claimed(
    cluster: LocalCluster, install: Callable[..., Installed], crds: list[str]
) -> None:
    inst = install()
    ns, agent, ctrl = inst.namespace, inst.user("agent"), inst.user("controller")
    can = lambda user, verb, res, *x: _can(cluster, user, ns, verb, res, *x)  # noqa: E731

    # Everything the chart grants (test_chart.py checks the rendered Roles grant exactly this) ...
    allowed = [(agent, *rbac.can_i(g)) for g in sorted(rbac.AGENT)]
    controller = rbac.CONTROLLER | rbac.CONTROLLER_CLUSTER_SCOPED | rbac.LEADER_ELECTION
    allowed += [(ctrl, *rbac.can_i(g)) for g in sorted(controller)]
    # ... and none of what it must not.
    denied = [
        (agent, "create", "pods"),
        (agent, "delete", "pods"),
        (agent, "update", "pods"),
        (agent, "get", "pods"),
        (agent, "update", "pods", "--subresource=status"),
        (agent, "patch", "pods", "--subresource=ephemeralcontainers"),
        (agent, "patch", "pods", "--subresource=resize"),
        (agent, "create", "pods", "--subresource=exec"),
        (agent, "create", "pods", "--subresource=eviction"),
        (agent, "get", "secrets"),
        (agent, "list", "secrets"),
        (agent, "patch", "nodes"),
        (agent, "get", "nodes"),
        (agent, "patch", "dynamocheckpoints.nvidia.com"),
        (agent, "patch", "dynamocheckpoints.nvidia.com", "--subresource=status"),
        (agent, "delete", "dynamocheckpoints.nvidia.com"),
        (agent, "create", "jobs.batch"),
        (agent, "list", "jobs.batch"),
        (agent, "delete", "events"),
        (agent, "get", "configmaps"),
        (ctrl, "get", "secrets"),
        (ctrl, "list", "secrets"),
        (ctrl, "patch", "nodes"),
        (ctrl, "delete", "nodes"),
        (ctrl, "patch", "pods"),
        (ctrl, "update", "pods"),
        (ctrl, "create", "pods", "--subresource=exec"),
        (ctrl, "patch", "pods", "--subresource=status"),
        (ctrl, "create", "deployments.apps"),
        (ctrl, "get", "configmaps"),
        (ctrl, "delete", "dynamographdeployments.nvidia.com"),
        (ctrl, "delete", "dynamocheckpoints.nvidia.com"),
        (ctrl, "update", "leases.coordination.k8s.io/kube-scheduler"),
        (ctrl, "delete", "leases.coordination.k8s.io/dynamo-snapshot-controller"),
        (ctrl, "create", "clusterroles.rbac.authorization.k8s.io"),
        (ctrl, "impersonate", "serviceaccounts"),
        (ctrl, "list", "customresourcedefinitions.apiextensions.k8s.io"),
        (ctrl, "get", "customresourcedefinitions.apiextensions.k8s.io/dynamoscalingpolicies.nvidia.com"),
        (ctrl, "update", f"customresourcedefinitions.apiextensions.k8s.io/{rbac.DGD_CRD}"),
    ]
    # One kubectl per question: asked in parallel, the matrix takes a second instead of several.
    with ThreadPoolExecutor(max_workers=8) as pool:
        granted = list(pool.map(lambda q: can(*q), allowed + denied))
    wrong = [
        (q[0].rsplit(":", 1)[1], *q[1:])
        for q, g in zip(allowed, granted[: len(allowed)], strict=True)
        if not g
    ]
    wrong += [
        (q[0].rsplit(":", 1)[1], *q[1:], "ALLOWED")
        for q, g in zip(denied, granted[len(allowed) :], strict=True)
        if g
    ]
    assert not wrong, f"RBAC differs from the claim: {wrong}"
    # Leader election is granted in the lease namespace only.
    assert not _can(cluster, ctrl, "default", "create", "leases.coordination.k8s.io")


def test_watch_namespace_limits_the_controller_to_it(
    cluster: LocalCluster, namespace: str, install: Callable[..., Installed], crds: list[str]
) -> None:
    inst = install({"controller": {"watchNamespace": namespace}})
    ctrl = inst.user("controller")
    assert _can(cluster, ctrl, namespace, "create", "pods")
    assert not _can(cluster, ctrl, "default", "create", "pods")
    assert not _can(cluster, ctrl, "default", "list", "dynamographdeployments.nvidia.com")
    assert _can(cluster, ctrl, "default", "list", "nodes"), "nodes are read cluster-wide all the same"


# --------------------------------------------------------------------------- the agent's admission policy

POLICY_KINDS = RBAC_KINDS | {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


@dataclass
class AgentNodes:
    inst: Installed
    nodes: list[str]
    agent_pods: dict[str, str]  # node -> the agent DaemonSet's pod there
    workers: dict[str, str]  # node -> a worker pod there

    def token(self, node: str | None) -> str:
        """A token of the agent's service account, bound to its pod on `node` (None: not bound)."""
        bound = self.agent_pods[node] if node else None
        return _token(self.inst.cluster, self.inst.namespace, self.inst.sa("agent"), bound)


def _pod(name: str, namespace: str, node: str, **metadata: Any) -> Obj:
    """A worker pod bound to ``node`` (kwok runs it); ``metadata``: its labels, annotations."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **metadata},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "worker"}]},
    }


@pytest.fixture
def agent_nodes(
    cluster: LocalCluster,
    install: Callable[..., Installed],
    gpu_node: Callable[..., Obj],
    crds: list[str],
) -> AgentNodes:
    """The chart's agent DaemonSet, RBAC and policy applied for real, on two fresh GPU nodes; one
    worker pod on each. kwok runs the DaemonSet's pods, so tokens can be bound to them."""
    # The DaemonSet keeps to these two nodes, off the GPU nodes of tests that run after this one.
    only_here = {"dynamo-snapshot.test/agent-nodes": uuid.uuid4().hex[:8]}
    nodes = [gpu_node(labels=only_here)["metadata"]["name"] for _ in range(2)]
    selector = {protocol.LABEL_GPU_PRESENT: "true", **only_here}
    inst = install({"agent": {"nodeSelector": selector}}, only=POLICY_KINDS | {"DaemonSet", "ConfigMap"})
    ns = inst.namespace
    ds = one(inst.objs, "DaemonSet")["metadata"]["name"]

    def agent_pods() -> dict[str, str]:
        out = cluster.kubectl(
            "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=agent", "-o", "json"
        )
        pods = {
            p["spec"].get("nodeName"): p["metadata"]["name"]
            for p in json.loads(out.stdout)["items"]
            if p["metadata"]["name"].startswith(ds)
        }
        return pods if all(n in pods for n in nodes) else {}

    pods = wait_for(agent_pods, what="the agent DaemonSet's pods on both GPU nodes")
    workers = {}
    for i, node in enumerate(nodes):
        name = f"worker-{i}"
        annotations = {protocol.ANNOTATION_RESTORE_FROM: "some-checkpoint"}
        cluster.apply(_pod(name, ns, node, labels={"app": "worker"}, annotations=annotations))
        workers[node] = name
    return AgentNodes(inst, nodes, pods, workers)


def _patch(
    cluster: LocalCluster,
    token: str,
    namespace: str,
    pod: str,
    body: Any,
    *,
    subresource: str = "",
    content_type: str = "application/merge-patch+json",
    query: str = "",
) -> tuple[int, str]:
    """One PATCH as the token's user, as the agent sends it (no GET first, unlike kubectl patch)."""
    url = f"{cluster.server}/api/v1/namespaces/{namespace}/pods/{pod}" + (
        f"/{subresource}" if subresource else ""
    )
    url += f"?{query}" if query else ""
    ctx = ssl.create_default_context(cafile=_ca(cluster))
    status, text = _http(
        url,
        ctx,
        data=json.dumps(body).encode(),
        method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": content_type},
    )
    if status == 200:
        return status, ""
    return status, str(json.loads(text).get("message", text))


def _wait_enforced(cluster: LocalCluster, token: str, namespace: str, pod: str) -> None:
    """The policy takes effect once the apiserver has loaded it: poll with a change it must refuse."""
    wait_for(
        # A fresh value each time: a change the apiserver let through before the policy was loaded
        # would make a repeat of it a no-op, which the policy rightly allows.
        lambda: (
            _patch(cluster, token, namespace, pod, {"metadata": {"labels": {"x": uuid.uuid4().hex}}})[0]
            == 403
        ),
        what="the ValidatingAdmissionPolicy to be enforced",
    )


def test_agent_may_only_annotate_pods_of_its_own_node(cluster: LocalCluster, agent_nodes: AgentNodes) -> None:
    a, b = agent_nodes.nodes
    ns = agent_nodes.inst.namespace
    token = agent_nodes.token(a)
    mine, theirs = agent_nodes.workers[a], agent_nodes.workers[b]
    status_key = "nvidia.com/snapshot-restore-status.main"

    def ann(values: dict[str, str | None]) -> Obj:
        return {"metadata": {"annotations": values}}

    _wait_enforced(cluster, token, ns, mine)

    ok = _patch(cluster, token, ns, mine, ann({status_key: "running"}))
    assert ok == (200, ""), ok
    assert _patch(cluster, token, ns, mine, ann({status_key: None})) == (200, ""), "removing its own is fine"
    ids = ann({protocol.ANNOTATION_RESTORED_CONTAINER_IDS: '{"main": "abc"}'})
    assert _patch(cluster, token, ns, mine, ids) == (200, ""), "the contract's restored-container-ids"

    merge, json_patch = "application/merge-patch+json", "application/json-patch+json"
    own_only = "the node agent may change only a pod's annotations"
    refused: list[tuple[str, str, Any, str, str]] = [
        ("another node's pod", theirs, ann({status_key: "running"}), merge, f"agent of node {a} may only"),
        ("a label", mine, {"metadata": {"labels": {"x": "changed"}}}, merge, own_only),
        ("the spec", mine, {"spec": {"activeDeadlineSeconds": 5}}, merge, own_only),
        ("a finalizer", mine, {"metadata": {"finalizers": ["example.com/hold"]}}, merge, own_only),
        (
            "a controller annotation",
            mine,
            ann({protocol.ANNOTATION_RESTORE_FROM: "another-checkpoint"}),
            merge,
            "may change only annotations starting with nvidia.com/snapshot- or "
            "nvidia.com/restored-container-ids, not nvidia.com/restore-from",
        ),
        (
            "removing a controller annotation",
            mine,
            [{"op": "remove", "path": "/metadata/annotations/nvidia.com~1restore-from"}],
            json_patch,
            "not nvidia.com/restore-from",
        ),
    ]
    for what, pod, body, ctype, message in refused:
        status, text = _patch(cluster, token, ns, pod, body, content_type=ctype)
        assert (status, message in text) == (403, True), f"{what}: {status} {text}"

    # A token not bound to a pod carries no node: no pod update at all.
    status, text = _patch(cluster, agent_nodes.token(None), ns, mine, ann({status_key: "x"}))
    assert (status, "token bound to its pod" in text) == (403, True), text

    # Subresources other than status are covered even where RBAC were widened to them.
    cluster.kubectl(
        "create", "role", "widen", "-n", ns, "--verb=patch", "--resource=pods/ephemeralcontainers"
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "widen",
        "-n",
        ns,
        "--role=widen",
        f"--serviceaccount={ns}:{agent_nodes.inst.sa('agent')}",
    )
    debug = {"spec": {"ephemeralContainers": [{"name": "debug", "image": "busybox"}]}}

    def ephemeral() -> tuple[int, str]:
        return _patch(cluster, token, ns, mine, debug, subresource="ephemeralcontainers")

    wait_for(lambda: "cannot patch" not in ephemeral()[1], what="the widened RBAC")
    status, text = ephemeral()
    assert (status, own_only in text) == (403, True), text

    # Everyone else is untouched by the policy.
    cluster.kubectl("label", "pod", mine, "-n", ns, "x=by-admin", "--overwrite")


APPLY = "application/apply-patch+yaml"
RESTORED = protocol.POD_CONDITION_RESTORED


def _restored(reason: str, status: str | None = None) -> Obj:
    """A Restored condition with ``reason`` (status: True for RestoreSucceeded unless given)."""
    if status is None:
        status = "True" if reason == protocol.RestoredReason.SUCCEEDED else "False"
    return {
        "type": RESTORED,
        "status": status,
        "reason": reason,
        "message": f"test {reason}",
        "lastTransitionTime": "2026-01-02T03:04:05Z",
    }


def _apply_conditions(name: str, namespace: str, *conditions: Obj) -> Obj:
    """A server-side apply body of pods/status that names only ``conditions``, as the agent sends it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"conditions": list(conditions)},
    }


def _pod_json(cluster: LocalCluster, namespace: str, name: str, *more: str) -> Obj:
    out = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json", *more)
    pod: Obj = json.loads(out.stdout)
    return pod


def _conditions(pod: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}


def test_agent_may_set_only_the_restored_condition_on_pods_of_its_node(
    cluster: LocalCluster, agent_nodes: AgentNodes
) -> None:
    """With a token bound to its pod, the agent applies nvidia.com/Restored (every reason of
    protocol.RestoredReason) on pods/status of a pod of its node; any other change through pods/status
    (another condition, another status field, the metadata, a reason not of the protocol, another node's
    pod) is refused by the policy, each with its own message."""
    a, b = agent_nodes.nodes
    ns = agent_nodes.inst.namespace
    token = agent_nodes.token(a)
    mine, theirs = agent_nodes.workers[a], agent_nodes.workers[b]
    _wait_enforced(cluster, token, ns, mine)
    # kwok reports the pods running once: from then on their status is only what is written here.
    for pod in (mine, theirs):
        wait_for(
            lambda pod=pod: _conditions(_pod_json(cluster, ns, pod)).get("Ready", {}).get("status") == "True",
            what=f"{pod} running",
        )
    before = _pod_json(cluster, ns, mine)["status"]
    ssa = "fieldManager=dynamo-snapshot-agent&force=true"

    def apply(pod: str, *conditions: Obj) -> tuple[int, str]:
        body = _apply_conditions(pod, ns, *conditions)
        return _patch(cluster, token, ns, pod, body, subresource="status", content_type=APPLY, query=ssa)

    for reason in protocol.RestoredReason:
        assert apply(mine, _restored(reason)) == (200, ""), reason
        restored = _conditions(_pod_json(cluster, ns, mine))[RESTORED]
        assert (restored["reason"], restored["message"]) == (reason, f"test {reason}")
    pod = _pod_json(cluster, ns, mine, "--show-managed-fields")
    after = pod["status"]
    assert {k: v for k, v in after.items() if k != "conditions"} == {
        k: v for k, v in before.items() if k != "conditions"
    }
    assert {t: c for t, c in _conditions(pod).items() if t != RESTORED} == _conditions({"status": before})
    [entry] = [m for m in pod["metadata"]["managedFields"] if m["manager"] == "dynamo-snapshot-agent"]
    assert (entry["operation"], entry["subresource"]) == ("Apply", "status")
    assert list(entry["fieldsV1"]["f:status"]["f:conditions"]) == [f'k:{{"type":"{RESTORED}"}}']

    only = f"on pods/status the node agent may change only the {RESTORED} condition, not "
    bad_reason = f"the {RESTORED} condition is True with reason RestoreSucceeded or False with reason"
    ready_false = {"type": "Ready", "status": "False", "reason": "Hijacked"}
    merge = "application/merge-patch+json"
    refused: list[tuple[str, str, Any, str, str]] = [
        (
            "Ready set False",
            mine,
            _apply_conditions(mine, ns, ready_false),
            APPLY,
            only + "the condition Ready",
        ),
        (
            "a condition of its own",
            mine,
            _apply_conditions(mine, ns, {"type": "example.com/Drained", "status": "True"}),
            APPLY,
            only + "the condition example.com/Drained",
        ),
        (
            "the conditions replaced by Restored alone",
            mine,
            {"status": {"conditions": [_restored("RestoreFailed")]}},
            merge,
            only + "the condition ",
        ),
        ("the pod IP", mine, {"status": {"podIP": "10.99.0.1"}}, merge, only + "status.podIP"),
        # (podIPs alone is no change: the apiserver keeps podIPs[0] equal to podIP.)
        (
            "the start time",
            mine,
            {"status": {"startTime": "2020-01-01T00:00:00Z"}},
            merge,
            only + "status.startTime",
        ),
        ("a status reason", mine, {"status": {"reason": "Evicted"}}, merge, only + "status.reason"),
        ("the phase", mine, {"status": {"phase": "Failed"}}, merge, only + "status.phase"),
        ("a status message", mine, {"status": {"message": "x"}}, merge, only + "status.message"),
        (
            "the container statuses",
            mine,
            {"status": {"containerStatuses": []}},
            merge,
            only + "status.containerStatuses",
        ),
        (
            "a label through pods/status",
            mine,
            {"metadata": {"labels": {"x": "via-status"}}},
            merge,
            only + "the metadata or spec",
        ),
        (
            "an annotation of ours through pods/status",
            mine,
            {"metadata": {"annotations": {"nvidia.com/snapshot-restore-status.main": "completed"}}},
            merge,
            only + "the metadata or spec",
        ),
        (
            "an unknown reason",
            mine,
            _apply_conditions(mine, ns, _restored("Whatever", "True")),
            APPLY,
            bad_reason,
        ),
        (
            "True with RestoreFailed",
            mine,
            _apply_conditions(mine, ns, _restored("RestoreFailed", "True")),
            APPLY,
            bad_reason,
        ),
        (
            "False with RestoreSucceeded",
            mine,
            _apply_conditions(mine, ns, _restored("RestoreSucceeded", "False")),
            APPLY,
            bad_reason,
        ),
        (
            "another node's pod",
            theirs,
            _apply_conditions(theirs, ns, _restored("RestoreSucceeded")),
            APPLY,
            f"agent of node {a} may only update pods on that node, not on {b}",
        ),
    ]
    for what, pod_name, body, ctype, message in refused:
        q = ssa if ctype == APPLY else ""
        status, text = _patch(
            cluster, token, ns, pod_name, body, subresource="status", content_type=ctype, query=q
        )
        assert (status, message in text) == (403, True), f"{what}: {status} {text}"
    assert _pod_json(cluster, ns, mine)["status"] == after, "a refused request changed the pod"
    assert RESTORED not in _conditions(_pod_json(cluster, ns, theirs))


# --------------------------------------------------------------------------- the processes, as their SAs


def _wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path, within: float = 60) -> None:
    def ready() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        return _http(f"http://127.0.0.1:{port}/readyz")[0] == 200

    wait_for(ready, within, "/readyz to answer 200")
    assert _http(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@contextlib.contextmanager
def _explained_by(log: Path) -> Iterator[None]:
    """A failed wait says why the process did not get there: its log (an RBAC denial shows as 403)."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\nprocess log:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert "forbidden" not in text.lower(), text[-4000:]


def test_controller_runs_on_its_rbac_alone(
    cluster: LocalCluster,
    namespace: str,
    install: Callable[..., Installed],
    crds: list[str],
    tmp_path: Path,
) -> None:
    """The rendered config and RBAC, as the controller's service account: leader election, informer
    sync, and Auto mode's writes (checkpoint, Job, worker pod, DGD status, Events) all go through."""
    inst = install({"controller": {"watchNamespace": namespace}}, only=RBAC_KINDS | {"ConfigMap"})
    proc, port, log = _start_controller_as_its_account(cluster, namespace, inst, tmp_path)
    get = _getter(cluster, namespace)
    try:
        with _explained_by(log):
            _wait_ready(port, proc, log)
            lease = cluster.kubectl(
                "get", "lease", "dynamo-snapshot-controller", "-n", namespace, "-o", "json"
            )
            assert json.loads(lease.stdout)["spec"]["holderIdentity"]

            dgd_crd.apply_file(cluster, namespace, AUTO_DGD)
            ckpts = wait_for(
                lambda: [c for c in get("dynamocheckpoints") if c.get("status")],
                what="a checkpoint with status",
            )
            assert ckpts[0]["status"]["phase"] in ("Creating", "Pending"), ckpts[0]["status"]
            wait_for(lambda: get("jobs"), what="the checkpoint Job")
            wait_for(
                lambda: get("pods", "-l", f"{protocol.LABEL_MANAGED_BY}={protocol.MANAGED_BY_VALUE}"),
                what="a worker pod",
            )
            wait_for(
                lambda: (get("dynamographdeployments")[0].get("status") or {}).get("observedGeneration"),
                what="the DGD's status",
            )
            wait_for(
                lambda: [e for e in get("events") if e.get("reason") == "CheckpointCreated"],
                what="the CheckpointCreated Event",
            )
    finally:
        rc = _stop(proc)
    assert rc == 0, log.read_text()[-3000:]


def test_controller_in_dynamo_operator_mode_leaves_dgds_to_the_operator(
    cluster: LocalCluster,
    namespace: str,
    install: Callable[..., Installed],
    crds: list[str],
    tmp_path: Path,
) -> None:
    """Beside NVIDIA's Dynamo operator (its DGD CRD installed), on the chart's dynamo-operator RBAC: the
    controller starts, runs the snapshot API (a SnapshotJob gets its Job), and creates nothing for a DGD:
    no worker pod, no checkpoint, no status."""
    values = {"mode": "dynamo-operator", "controller": {"watchNamespace": namespace}}
    with dgd_crd.dgd_crd_as(cluster, dgd_crd.operators()):
        inst = install(values, only=RBAC_KINDS | {"ConfigMap"})
        ctrl = inst.user("controller")
        # The autoscaler reads the operator's DGDs; nothing of ours writes their status or creates one.
        assert _can(cluster, ctrl, namespace, "list", "dynamographdeployments.nvidia.com")
        assert not _can(cluster, ctrl, namespace, "create", "dynamographdeployments.nvidia.com")
        assert not _can(
            cluster, ctrl, namespace, "update", "dynamographdeployments.nvidia.com", "--subresource=status"
        )
        assert _can(
            cluster, ctrl, namespace, "get", f"customresourcedefinitions.apiextensions.k8s.io/{rbac.DGD_CRD}"
        )
        cluster.kubectl("apply", "-n", namespace, "-f", str(AUTO_DGD))
        proc, port, log = _start_controller_as_its_account(cluster, namespace, inst, tmp_path)
        get = _getter(cluster, namespace)
        try:
            with _explained_by(log):
                _wait_ready(port, proc, log)
                cluster.apply(_snapshot_job("probe"), namespace)
                wait_for(lambda: get("jobs"), what="the SnapshotJob's Job")

                def made_for_the_dgd() -> list[str]:
                    found = [f"pod {p['metadata']['name']}" for p in get("pods", "-l", protocol.LABEL_GRAPH)]
                    found += [f"checkpoint {c['metadata']['name']}" for c in get("dynamocheckpoints")]
                    found += [
                        f"status of {d['metadata']['name']}"
                        for d in get("dynamographdeployments")
                        if d.get("status")
                    ]
                    return found

                # In mode standalone the DGD's checkpoint and pods appear within a second of the caches'
                # sync (test_controller_runs_on_its_rbac_alone); here nothing does, however long we look.
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    assert made_for_the_dgd() == []
                    time.sleep(0.5)
        finally:
            rc = _stop(proc)
    assert rc == 0, log.read_text()[-3000:]
    assert '"mode": "dynamo-operator"' in log.read_text()


def _start_controller_as_its_account(
    cluster: LocalCluster, namespace: str, inst: Installed, tmp_path: Path
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """The controller process with the chart's rendered config, as the chart's service account (a
    token of it); its log in tmp_path/controller.log."""
    config = tmp_path / "config.yaml"
    config.write_text(one(inst.objs, "ConfigMap", "-controller")["data"]["config.yaml"])
    token = _token(cluster, namespace, inst.sa("controller"))
    kubeconfig = _kubeconfig_for(cluster, token, tmp_path / "kubeconfig")
    port, log = free_port(), tmp_path / "controller.log"
    args = ["controller", "--config", str(config), "--kubeconfig", str(kubeconfig)]
    args += ["--metrics-port", "0", "--health-port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=out)
    return proc, port, log


def _getter(cluster: LocalCluster, namespace: str) -> Callable[..., list[Obj]]:
    def get(kind: str, *selector: str) -> list[Obj]:
        out = cluster.kubectl("get", kind, "-n", namespace, *selector, "-o", "json")
        return list(json.loads(out.stdout)["items"])

    return get


def _snapshot_job(name: str) -> Obj:
    """A SnapshotJob whose pod never schedules (no node has its label): its Job is all it gets."""
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "SnapshotJob",
        "metadata": {"name": name},
        "spec": {
            "podSnapshotTemplate": {"targetContainers": ["main"]},
            "podTemplate": {
                "spec": {
                    "nodeSelector": {"dynamo-snapshot.test/nowhere": "true"},
                    "containers": [{"name": "main", "image": "worker:1"}],
                }
            },
        },
    }


@pytest.mark.criu
def test_agent_runs_and_reports_through_the_policy(
    cluster: LocalCluster, agent_nodes: AgentNodes, criu_bin: Path, tmp_path: Path
) -> None:
    """The agent process as its service account, with a token bound to its DaemonSet pod (what the
    kubelet mounts): it lists its node's pods, and its annotation reports and its Restored condition
    pass RBAC and the admission policy."""
    a, b = agent_nodes.nodes
    ns = agent_nodes.inst.namespace
    config = tmp_path / "config.yaml"
    rendered = yaml.safe_load(one(agent_nodes.inst.objs, "ConfigMap", "-agent")["data"]["config.yaml"])
    roots = {k: str(tmp_path / k) for k in ("artifactRoot", "controlRoot", "stateRoot")}
    config.write_text(yaml.safe_dump({**rendered, **roots, "runtime": "local"}))
    kubeconfig = _kubeconfig_for(cluster, agent_nodes.token(a), tmp_path / "kubeconfig")
    port, log = free_port(), tmp_path / "agent.log"
    args = ["agent", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", a]
    args += ["--metrics-port", "0", "--health-port", str(port), "--criu", str(criu_bin)]
    # A restore target on each node, from a checkpoint that does not exist: the agent on node a reports
    # the failed restore in annotations; the pod on node b is not its business.
    labels = {
        protocol.LABEL_RESTORE_TARGET: protocol.TRUE,
        protocol.LABEL_CHECKPOINT_HASH: "00000000deadbeef",
    }
    for node in (a, b):
        cluster.apply(_pod(f"restore-{node}", ns, node, labels=labels))
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=out)
    try:
        with _explained_by(log):
            _wait_ready(port, proc, log)
            key = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")

            def status(pod: str) -> str:
                out = cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "json")
                return str((json.loads(out.stdout)["metadata"].get("annotations") or {}).get(key, ""))

            wait_for(lambda: status(f"restore-{a}") == "failed", what="the agent's report on its node's pod")
            assert status(f"restore-{b}") == "", "the agent touched another node's pod"
            # The same outcome as the pod's nvidia.com/Restored condition, through RBAC and the policy.
            refused = wait_for(
                lambda: _conditions(_pod_json(cluster, ns, f"restore-{a}")).get(RESTORED),
                what="the Restored condition",
            )
            message = _pod_json(cluster, ns, f"restore-{a}")["metadata"]["annotations"][
                protocol.per_container(protocol.ANNOTATION_RESTORE_MESSAGE, "main")
            ]
            assert (refused["status"], refused["reason"], refused["message"]) == (
                "False",
                protocol.RestoredReason.FAILED,
                message,
            )
            assert message.startswith("refused: "), message
            assert RESTORED not in _conditions(_pod_json(cluster, ns, f"restore-{b}"))
    finally:
        rc = _stop(proc)
    assert rc == 0, log.read_text()[-3000:]
