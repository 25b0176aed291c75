"""A stand-in for NVIDIA's Dynamo operator in tests, not the operator: it makes a DGD's component pods the
way the operator's Deployment workload provider does, so that the controller's failover in mode
dynamo-operator can be tested against the real apiserver.

- A Deployment per component, whose controller is the DGD (the operator puts a DynamoComponentDeployment
  between them; the controller chain accepts both), whose pod template carries the labels the operator
  stamps on a DGD's pods (nvidia.com/dynamo-graph-deployment-name, nvidia.com/dynamo-component).
- The stand-in admission step: a checkpointed component's template carries nvidia.com/restore-from with
  its PodSnapshot's name, which is what Dynamo's pod-create webhook (PodCheckpointRestoreMutator) leaves on
  each new pod of a component whose PodSnapshot is Ready. The session cluster's kube-controller-manager
  runs the Deployment's ReplicaSet; kwok runs its pods.
- A PodSnapshot made Ready and bound as Dynamo's snapshot controller leaves it (or left not Ready), and
  the ways a worker dies: its container crash-looping under the kubelet, its node going NotReady (and
  back).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import now_rfc3339
from dynamo_snapshot.controller.podspec import owner_reference
from dynamo_snapshot.kube import NODE, POD, Kube, Obj, ResourceKind
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import DGD, POD_SNAPSHOT
from dynamo_snapshot_dev.localcluster.nodes import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE

DEPLOYMENT = ResourceKind("apps", "v1", "deployments", "Deployment")
REPLICA_SET = ResourceKind("apps", "v1", "replicasets", "ReplicaSet")
WORKER_IMAGE = "vllm-runtime:test"


def worker_template(graph: str, component: str, nodes: list[str], restore_from: str | None) -> Obj:
    """A component's pod template as the operator renders it (and its webhook leaves it), kept to
    ``nodes``."""
    annotations = {protocol.ANNOTATION_RESTORE_FROM: restore_from} if restore_from else {}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]
                    }
                ]
            }
        }
    }
    return {
        "metadata": {
            "labels": {protocol.LABEL_DYNAMO_GRAPH: graph, protocol.LABEL_DYNAMO_COMPONENT: component},
            "annotations": annotations,
        },
        "spec": {
            "affinity": affinity,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": WORKER_IMAGE, "command": ["python3", "-m", "dynamo.vllm"]}
            ],
        },
    }


@dataclass
class StandInOperator:
    kube: Kube
    namespace: str

    async def dgd(self, name: str, components: tuple[str, ...]) -> Obj:
        """The DGD the operator runs (the controller in mode dynamo-operator only reads it)."""
        services = {c: {"componentType": "worker", "replicas": 1} for c in components}
        manifest = {
            "apiVersion": DGD.api_version,
            "kind": DGD.kind,
            "metadata": {"name": name},
            "spec": {"backendFramework": "vllm", "services": services},
        }
        # Written at the version the CRD stores (its Deployments' ownerReferences name that version).
        return await DgdClient(self.kube).create(manifest, self.namespace)

    async def component(
        self,
        dgd: Obj,
        component: str,
        *,
        replicas: int,
        nodes: list[str],
        restore_from: str | None,
        owned: bool = True,
    ) -> Obj:
        """The component's Deployment, its controller the DGD (``owned``) or nothing."""
        graph = dgd["metadata"]["name"]
        template = worker_template(graph, component, nodes, restore_from)
        name = f"{graph}-{component}".lower()
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": name,
                "labels": dict(template["metadata"]["labels"]),
                "ownerReferences": [owner_reference(dgd)] if owned else [],
            },
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": dict(template["metadata"]["labels"])},
                "template": template,
            },
        }
        return await self.kube.create(DEPLOYMENT, deployment, self.namespace)

    async def pods(self, component: str, namespace: str | None = None) -> list[Obj]:
        """The component's pods that are not being deleted."""
        pods, _ = await self.kube.list_all(
            POD, namespace or self.namespace, label_selector=f"{protocol.LABEL_DYNAMO_COMPONENT}={component}"
        )
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    async def snapshot(self, name: str, *, ready: bool) -> Obj:
        """A PodSnapshot of the namespace; ``ready``: captured, bound and Ready, as the snapshot controller
        and node agent leave it."""
        manifest = {
            "apiVersion": POD_SNAPSHOT.api_version,
            "kind": POD_SNAPSHOT.kind,
            "metadata": {"name": name},
            "spec": {
                "source": {
                    "podRef": {"name": f"{name}-source", "uid": str(uuid.uuid4()), "containers": ["main"]}
                }
            },
        }
        created = await self.kube.create(POD_SNAPSHOT, manifest, self.namespace)
        if not ready:
            return created
        conditions = cond.set_condition([], cond.READY, True, "Captured", "captured and verified", None)
        conditions = cond.set_condition(conditions, cond.FAILED, False, "Captured", "captured", None)
        status = {
            "boundSnapshotContentName": f"podsnapshotcontent-{created['metadata']['uid']}",
            "conditions": conditions,
        }
        return await self.kube.patch_status(POD_SNAPSHOT, name, status, self.namespace)


async def crash_loop(kube: Kube, pod: Obj) -> None:
    """What the kubelet reports of a worker whose container keeps dying: restarted in place, waiting in
    CrashLoopBackOff."""
    status = {
        "containerStatuses": [
            {
                "name": "main",
                "image": WORKER_IMAGE,
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": now_rfc3339()}},
            }
        ]
    }
    meta = pod["metadata"]
    await kube.patch_status(POD, meta["name"], status, meta["namespace"])


async def fail_node(kube: Kube, node: str) -> None:
    """Take a kwok node from kwok (no more heartbeats) and report it NotReady since now, as a dead
    kubelet's node looks once the node controller notices."""
    await kube.merge_patch(NODE, node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: None}}})
    await _set_ready(kube, node, "False", "KubeletStopped")


async def heal_node(kube: Kube, node: str) -> None:
    """Hand the node back to kwok (heartbeats again) and report it Ready."""
    await kube.merge_patch(NODE, node, {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE}}})
    await _set_ready(kube, node, "True", "KubeletReady")


async def _set_ready(kube: Kube, node: str, status: str, reason: str) -> None:
    # The transition time is where the node grace starts, as the kubelet or node controller sets it.
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    current = await kube.get(NODE, node)
    conditions = [
        {**c, "status": status, "reason": reason, "message": "test", "lastTransitionTime": now}
        if c.get("type") == "Ready"
        else c
        for c in (current.get("status") or {}).get("conditions") or []
    ]
    await kube.merge_patch(NODE, node, {"status": {"conditions": conditions}}, subresource="status")
