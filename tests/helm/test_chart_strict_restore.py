"""Strict restore against the real apiserver: the chart's ValidatingAdmissionPolicies admit a pod that asks
for a restore, and a pod template that does, only from the controller's service account and the users the
values list; with strict restore off, a pod made by hand in the namespace restores as docs/security.md
says."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helm.chart import Obj, render
from tests.helpers.polling import wait_for

pytestmark = pytest.mark.cluster

POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
TENANT = "tenant-alice"  # a user who may create pods in the namespace, and nothing more here
CI_USER = "release-ci"
OPERATOR = "system:serviceaccount:dynamo-system:dynamo-operator"
RESTORE_FROM = protocol.ANNOTATION_RESTORE_FROM

LWS_CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets", "singular": "leaderworkerset"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


@dataclass
class Strict:
    cluster: LocalCluster
    namespace: str
    controller: str  # the controller's service account, as request.userInfo.username names it

    def as_user(self, user: str, *args: str, body: Obj | None = None) -> subprocess.CompletedProcess[str]:
        """kubectl as ``user`` (in system:masters, so RBAC allows everything and only admission judges)."""
        return self.cluster.kubectl(
            "--as",
            user,
            "--as-group",
            "system:masters",
            "-n",
            self.namespace,
            *args,
            input=None if body is None else json.dumps(body),
            check=False,
        )

    def create(self, user: str, body: Obj) -> subprocess.CompletedProcess[str]:
        return self.as_user(user, "create", "-f", "-", body=body)


def _strict_values(namespace: str, **more: list[str]) -> Obj:
    selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return {"strictRestore": {"enabled": True, "namespaceSelector": selector, **more}}


@pytest.fixture
def dgd(cluster: LocalCluster, namespace: str, crds: list[str]) -> Obj:
    """A DynamoGraphDeployment of the namespace, at the version the installed CRD serves (only its
    identity matters here: it is what a hand-made pod names as its owner)."""
    crd = json.loads(cluster.kubectl("get", "crd", "dynamographdeployments.nvidia.com", "-o", "json").stdout)
    version = next(v["name"] for v in crd["spec"]["versions"] if v["served"])
    manifest = {
        "apiVersion": f"nvidia.com/{version}",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "graph", "namespace": namespace},
        "spec": {},
    }
    made: Obj = json.loads(
        cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(manifest)).stdout
    )
    return made


@pytest.fixture
def strict(cluster: LocalCluster, namespace: str) -> Iterator[Callable[..., Strict]]:
    """Applies the chart's strict-restore policies, bound to the test's namespace alone (the cluster is
    shared), and takes them away after the test."""
    applied: list[Obj] = []

    def apply(**more: list[str]) -> Strict:
        release = f"t{uuid.uuid4().hex[:6]}"
        objs = render(_strict_values(namespace, **more), release=release, namespace="dynamo-system")
        policies = [o for o in objs if o["kind"] in POLICY_KINDS]
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in policies))
        applied.extend(policies)
        controller = f"system:serviceaccount:dynamo-system:{release}-dynamo-snapshot-controller"
        return Strict(cluster, namespace, controller)

    yield apply
    for o in applied:
        cluster.kubectl("delete", o["kind"], o["metadata"]["name"], "--ignore-not-found", check=False)


def _pod(name: str, *, restore_from: str | None = None, owner: Obj | None = None) -> Obj:
    meta: Obj = {"name": name}
    if restore_from is not None:
        meta["annotations"] = {RESTORE_FROM: restore_from}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "image": "worker"}]},
    }


def _hand_made(dgd: Obj) -> Obj:
    """A pod made by hand that claims to be one of the DGD's restore pods."""
    return _pod(
        f"hand-made-{uuid.uuid4().hex[:6]}", restore_from=f"{dgd['metadata']['name']}-ckpt", owner=dgd
    )


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert "strict restore" in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def _admitted(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr


def _enforced(s: Strict, attempt: Callable[[], subprocess.CompletedProcess[str]]) -> str:
    """The policies take effect once the apiserver has loaded them: retry a request they must refuse."""

    def refused() -> str:
        proc = attempt()
        return proc.stderr if proc.returncode != 0 and "strict restore" in proc.stderr else ""

    return wait_for(refused, what="the strict-restore policies to be enforced")


def test_strict_restore_is_off_by_default_and_a_hand_made_pod_restores_from_the_namespace(
    cluster: LocalCluster, namespace: str, dgd: Obj
) -> None:
    """As docs/security.md says: within a namespace, whoever may create pods may ask for a restore,
    with an ownerReference to a DGD too; the agent's checks separate namespaces and DGDs, not users."""
    names = [o["metadata"]["name"] for o in render() if o["kind"] in POLICY_KINDS]
    assert not [n for n in names if "-restore-" in n], names
    s = Strict(cluster, namespace, controller="")
    _admitted(s.create(TENANT, _hand_made(dgd)))


def test_strict_restore_admits_restore_pods_only_from_the_controller_and_listed_users(
    strict: Callable[..., Strict], dgd: Obj
) -> None:
    s = strict(podCreators=[CI_USER])
    message = _enforced(s, lambda: s.create(TENANT, _hand_made(dgd)))
    # The message names who asked, who may, and where that is set.
    for word in (TENANT, s.controller, CI_USER, "strictRestore.podCreators", "docs/security.md"):
        assert word in message

    # The controller's own restore pods pass, as do those of a listed user; pods without the annotation
    # are anyone's.
    ours = _hand_made(dgd)
    _admitted(s.create(s.controller, ours))
    _admitted(s.create(CI_USER, _hand_made(dgd)))
    plain = _pod(f"plain-{uuid.uuid4().hex[:6]}")
    _admitted(s.create(TENANT, plain))

    # Asking later is asking too.
    name = plain["metadata"]["name"]
    _refused(s.as_user(TENANT, "annotate", "pod", name, f"{RESTORE_FROM}=x"), TENANT)

    # On a restore pod, the annotation and the spec are the allowed users' alone: another value, an
    # ephemeral container beside the restored process, a new image.
    ours_name = ours["metadata"]["name"]
    _refused(s.as_user(TENANT, "annotate", "--overwrite", "pod", ours_name, f"{RESTORE_FROM}=other"))
    debug = {
        "spec": {"ephemeralContainers": [{"name": "peek", "image": "busybox", "targetContainerName": "main"}]}
    }
    _refused(
        s.as_user(
            TENANT, "patch", "pod", ours_name, "--subresource=ephemeralcontainers", "-p", json.dumps(debug)
        )
    )
    image = {"spec": {"containers": [{"name": "main", "image": "other"}]}}
    _refused(s.as_user(TENANT, "patch", "pod", ours_name, "-p", json.dumps(image)))

    # What others write on a restore pod stays open: other annotations (the agent's), the status (the
    # kubelet's, and the agent's nvidia.com/Restored condition), and removing the request.
    _admitted(
        s.as_user(TENANT, "annotate", "pod", ours_name, "nvidia.com/snapshot-restore-status.main=running")
    )
    condition = {"status": {"conditions": [{"type": protocol.POD_CONDITION_RESTORED, "status": "False"}]}}
    _admitted(
        s.as_user(TENANT, "patch", "pod", ours_name, "--subresource=status", "-p", json.dumps(condition))
    )
    _admitted(s.as_user(TENANT, "annotate", "pod", ours_name, f"{RESTORE_FROM}-"))


def _deployment(name: str, *, restore_from: str | None) -> Obj:
    labels = {"app": name}
    template: Obj = {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": "main", "image": "worker"}]},
    }
    if restore_from is not None:
        template["metadata"]["annotations"] = {RESTORE_FROM: restore_from}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
    }


@pytest.fixture
def lws_crd(cluster: LocalCluster) -> Iterator[None]:
    """LeaderWorkerSet's kind, served (its schema left open: only the template's place matters here)."""
    cluster.apply(LWS_CRD)
    wait_for(
        lambda: cluster.kubectl("get", "leaderworkersets", "-A", check=False).returncode == 0,
        what="the LeaderWorkerSet CRD to be served",
    )
    yield
    cluster.kubectl("delete", "crd", LWS_CRD["metadata"]["name"], "--wait=false", check=False)


@pytest.mark.usefixtures("lws_crd")
def test_strict_restore_admits_templates_that_ask_for_a_restore_only_from_listed_writers(
    strict: Callable[..., Strict], cluster: LocalCluster
) -> None:
    """Mode dynamo-operator: the workload controllers create the pods, from templates the operator writes
    (and the Deployment controller copies into ReplicaSets)."""
    # The test cluster's controller-manager, whose Deployment and ReplicaSet controllers copy the template
    # into a ReplicaSet and create the pods, runs as the admin kubeconfig's user.
    whoami = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    kube_controllers = whoami.stdout.strip()
    s = strict(podCreators=[kube_controllers], templateWriters=[OPERATOR, kube_controllers])

    def tenant_deployment() -> subprocess.CompletedProcess[str]:
        return s.create(TENANT, _deployment(f"tenant-{uuid.uuid4().hex[:6]}", restore_from="ckpt"))

    message = _enforced(s, tenant_deployment)
    for word in (TENANT, OPERATOR, RESTORE_FROM, protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE):
        assert word in message
    assert "strictRestore.templateWriters" in message

    # The operator's Deployment is admitted, and so are the ReplicaSet and the pod the controller-manager
    # makes from it: the pod rule admits the listed pod creators.
    _admitted(s.create(OPERATOR, _deployment("worker", restore_from="ckpt")))
    pod = wait_for(
        lambda: json.loads(s.as_user(TENANT, "get", "pods", "-l", "app=worker", "-o", "json").stdout)[
            "items"
        ],
        what="the operator's Deployment's pod",
    )[0]
    assert pod["metadata"]["annotations"][RESTORE_FROM] == "ckpt"

    # Others may scale it or annotate the Deployment itself, but not change its template.
    _admitted(s.as_user(TENANT, "scale", "deployment", "worker", "--replicas=2"))
    _admitted(s.as_user(TENANT, "annotate", "deployment", "worker", "note=hello"))
    _refused(s.as_user(TENANT, "set", "image", "deployment/worker", "main=other"), TENANT)

    # A template without the request is anyone's, until it asks for a restore.
    _admitted(s.create(TENANT, _deployment("plain", restore_from=None)))
    add = {
        "spec": {
            "template": {"metadata": {"annotations": {protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE: "true"}}}
        }
    }
    _refused(s.as_user(TENANT, "patch", "deployment", "plain", "-p", json.dumps(add)))

    # The CronJob's and the LeaderWorkerSet's templates are where those kinds keep them.
    job_template = {"spec": {"template": _deployment("x", restore_from="ckpt")["spec"]["template"]}}
    job_template["spec"]["template"]["spec"]["restartPolicy"] = "Never"
    cron = {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "nightly"},
        "spec": {"schedule": "0 0 * * *", "jobTemplate": job_template},
    }
    _refused(s.create(TENANT, cron), TENANT)
    _admitted(s.create(OPERATOR, cron))

    worker_template = _deployment("x", restore_from="ckpt")["spec"]["template"]
    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "multinode"},
        "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": worker_template}},
    }
    _refused(s.create(TENANT, lws), TENANT)
    _admitted(s.create(OPERATOR, lws))
