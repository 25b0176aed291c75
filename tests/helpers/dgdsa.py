"""NVIDIA Dynamo's DynamoGraphDeploymentScalingAdapter (DGDSA) in the session cluster, and a stand-in for what
Dynamo's operator does with adapters.

The CRD carries the fields of ai-dynamo/dynamo deploy/operator/config/crd/bases/
nvidia.com_dynamographdeploymentscalingadapters.yaml (v1alpha1: spec.replicas, spec.dgdRef{name,
serviceName}, status.replicas/selector/lastScaleTime) with its scale subresource (specReplicasPath
.spec.replicas, statusReplicasPath .status.replicas, labelSelectorPath .status.selector), written here
from that schema.

``OperatorStandIn`` is NOT Dynamo's operator: it does, by polling, the two things of its DGD reconciler and
adapter reconciler that outside autoscalers depend on (internal/controller/dynamographdeployment_controller.go
reconcileScalingAdapters and the adapter controller): one adapter per v1beta1 component, named
``<dgd>-<lowercased component>`` and labelled with the DGD and component names, its spec.replicas
seeded from the component; then each adapter's spec.replicas copied to its component's replicas, and
status.replicas and status.selector kept current. Nothing else of the operator (pods, status) is played.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.autoscale.targets import DGDSA_CRD_NAME, adapter_kind
from dynamo_snapshot.kube import ApiError, Kube, ResourceKind
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.dgd_crd import OPERATOR_ANNOTATIONS, OPERATOR_LABELS
from tests.helpers.polling import wait_for

Obj = dict[str, Any]
ADAPTER = adapter_kind("v1alpha1")
DGD_V1BETA1 = ResourceKind("nvidia.com", "v1beta1", "dynamographdeployments", "DynamoGraphDeployment")
# The stand-in's field manager: the DGD's managedFields tell its writes from anyone else's.
STAND_IN_MANAGER = "dynamo-operator-stand-in"


def _int32(minimum: int | None = None) -> Obj:
    out: Obj = {"type": "integer", "format": "int32"}
    if minimum is not None:
        out["minimum"] = minimum
    return out


def crd() -> Obj:
    """The DGDSA CRD (v1alpha1, served and stored), as the Dynamo platform chart installs it."""
    dgd_ref = {
        "type": "object",
        "required": ["name", "serviceName"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "serviceName": {"type": "string", "minLength": 1},
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["dgdRef", "replicas"],
                "properties": {"dgdRef": dgd_ref, "replicas": _int32(0)},
            },
            "status": {
                "type": "object",
                "properties": {
                    "lastScaleTime": {"type": "string", "format": "date-time"},
                    "replicas": _int32(),
                    "selector": {"type": "string"},
                },
            },
        },
    }
    version = {
        "name": "v1alpha1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": DGDSA_CRD_NAME,
            "labels": dict(OPERATOR_LABELS),
            "annotations": dict(OPERATOR_ANNOTATIONS),
        },
        "spec": {
            "group": "nvidia.com",
            "scope": "Namespaced",
            "names": {
                "kind": ADAPTER.kind,
                "listKind": f"{ADAPTER.kind}List",
                "plural": ADAPTER.plural,
                "singular": ADAPTER.kind.lower(),
                "shortNames": ["dgdsa"],
            },
            "versions": [version],
        },
    }


@contextlib.contextmanager
def dgdsa_crd_installed(cluster: LocalCluster) -> Iterator[None]:
    """The DGDSA CRD exists inside the block (and is served); deleted after it, with every adapter."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd()))
    wait_for(
        lambda: cluster.kubectl("get", ADAPTER.plural, "-A", check=False).returncode == 0,
        within=30,
        what="DGDSAs served",
    )
    try:
        yield
    finally:
        cluster.kubectl("delete", "crd", DGDSA_CRD_NAME, "--wait=true", "--timeout=60s", check=False)


def adapter_name(dgd: str, component: str) -> str:
    return f"{dgd}-{component.lower()}"


class OperatorStandIn:
    """See the module docstring: adapters per component, their replicas copied to the DGD."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace

    async def run(self, every: float = 0.2) -> None:
        while True:
            # A failed round (a write that raced the autoscaler's) is simply done again.
            with contextlib.suppress(ApiError):
                dgds, _ = await self.kube.list_all(DGD_V1BETA1, self.namespace)
                for dgd in dgds:
                    await self._sync(dgd)
            await asyncio.sleep(every)

    async def _sync(self, dgd: Obj) -> None:
        name = dgd["metadata"]["name"]
        for i, component in enumerate((dgd.get("spec") or {}).get("components") or []):
            cname = component["name"]
            replicas = 1 if component.get("replicas") is None else int(component["replicas"])
            adapter = await self._adapter(name, cname, replicas)
            wanted = int(adapter["spec"]["replicas"])
            if wanted != replicas:
                ops = [
                    {"op": "test", "path": f"/spec/components/{i}/name", "value": cname},
                    {"op": "add", "path": f"/spec/components/{i}/replicas", "value": wanted},
                ]
                await self.kube.json_patch(
                    DGD_V1BETA1, name, ops, self.namespace, field_manager=STAND_IN_MANAGER
                )
            selector = f"{protocol.LABEL_DYNAMO_GRAPH}={name},{protocol.LABEL_DYNAMO_COMPONENT}={cname}"
            status = adapter.get("status") or {}
            if status.get("replicas") != wanted or status.get("selector") != selector:
                await self.kube.merge_patch(
                    ADAPTER,
                    adapter["metadata"]["name"],
                    {"status": {"replicas": wanted, "selector": selector}},
                    self.namespace,
                    subresource="status",
                    field_manager=STAND_IN_MANAGER,
                )

    async def _adapter(self, dgd: str, component: str, replicas: int) -> Obj:
        try:
            return await self.kube.get(ADAPTER, adapter_name(dgd, component), self.namespace)
        except ApiError as e:
            if e.status != 404:
                raise
        body = {
            "metadata": {
                "name": adapter_name(dgd, component),
                "labels": {protocol.LABEL_DYNAMO_GRAPH: dgd, protocol.LABEL_DYNAMO_COMPONENT: component},
            },
            "spec": {"replicas": replicas, "dgdRef": {"name": dgd, "serviceName": component}},
        }
        return await self.kube.create(ADAPTER, body, self.namespace, field_manager=STAND_IN_MANAGER)


@contextlib.asynccontextmanager
async def operator_stand_in(kube: Kube, namespace: str) -> AsyncIterator[None]:
    """``OperatorStandIn`` running in the background inside the block."""
    task = asyncio.create_task(OperatorStandIn(kube, namespace).run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
