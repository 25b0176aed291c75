"""Where a DynamoScalingPolicy's target (dgdName + serviceName) has its replicas: read and written.

In mode standalone this controller runs the DGDs (``OwnDgds``): the count is the service's replicas of
the controller's cached view (v1alpha1's ``spec.services[name].replicas``), written at the version the
DGDs are read at (kube/dgd_versions.py), and the DGD reconciler turns it into pods.

Beside NVIDIA's Dynamo operator (``OperatorDgds``), the operator owns the DGDs and offers outside
autoscalers one DynamoGraphDeploymentScalingAdapter (DGDSA) per service, with a ``scale`` subresource: the
count is written to the adapter's Scale, and the operator copies it to the DGD. Where the DGDSA CRD is not
installed, or a service has no adapter (disabled on it), the DGD itself is written: v1beta1's
``spec.components[i].replicas`` by a JSON patch whose ``test`` op pins the component's name at that
index, so a concurrent reorder fails the write instead of scaling another component; v1alpha1's services
map by a merge patch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Final, Protocol

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.dynamo_views import (
    ComponentView,
    GraphDeploymentView,
    ScalingAdapterView,
    ServiceView,
    StoredGraphDeploymentView,
)
from dynamo_snapshot.api.views import Meta, ObjectView
from dynamo_snapshot.kube import ApiError, Informer, Kube, Obj, ResourceKind, is_not_found
from dynamo_snapshot.kube.dgd_versions import DgdVersion, read_version
from dynamo_snapshot.kube.kinds import CRD, DGD, POD
from dynamo_snapshot.kube.pods import pods_of

__all__ = [
    "DGDSA_CRD_NAME",
    "DGD_CRD_NAME",
    "Found",
    "OperatorDgds",
    "OwnDgds",
    "ScaleFailed",
    "Targets",
    "adapter_kind",
    "read_version",
]

log = logging.getLogger(__name__)

_ADAPTER_PLURAL: Final = "dynamographdeploymentscalingadapters"
_ADAPTER_KIND: Final = "DynamoGraphDeploymentScalingAdapter"
DGD_CRD_NAME: Final = f"{DGD.plural}.{DGD.group}"
DGDSA_CRD_NAME: Final = f"{_ADAPTER_PLURAL}.{protocol.API_GROUP}"
_V1BETA1: Final = protocol.API_VERSION_V1BETA1
_V1ALPHA1: Final = protocol.API_VERSION


def adapter_kind(version: str) -> ResourceKind:
    return ResourceKind(protocol.API_GROUP, version, _ADAPTER_PLURAL, _ADAPTER_KIND)


class ScaleFailed(Exception):
    """The target could not be written; ``reason`` is the policy condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Found:
    """A policy's target as read now: its DGD, its replica count, and what is written to change it."""

    dgd: Obj
    service: str
    replicas: int
    adapter: Obj | None = None  # the DGDSA written through, when there is one
    index: int | None = None  # v1beta1: the component's index in spec.components

    @property
    def written(self) -> str:
        """What a scale writes, for messages."""
        if self.adapter is not None:
            return f"{_ADAPTER_KIND} {Meta(self.adapter).name}"
        return f"DynamoGraphDeployment {Meta(self.dgd).name}"


class Targets(Protocol):
    """How the autoscaler reads and writes its targets; ``open`` before use, ``close`` after."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def find(self, namespace: str, dgd_name: str, service: str) -> Found | str:
        """The target; else what does not exist (the DGD, or its service), as a sentence's subject."""
        ...

    async def scale(self, found: Found, desired: int) -> None:
        """Write ``desired``; ScaleFailed when it cannot be."""
        ...

    def pods(self, namespace: str, dgd_name: str, service: str) -> list[Obj]: ...


class OwnDgds:
    """Mode standalone: this controller's DGDs (cached as views) and worker pods, from its caches."""

    def __init__(self, kube: Kube, dgds: Informer, pods: Informer, version: DgdVersion | None = None) -> None:
        self.kube, self.dgds, self._pods = kube, dgds, pods
        self.version = version or DgdVersion()

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def find(self, namespace: str, dgd_name: str, service: str) -> Found | str:
        dgd = self.dgds.get(f"{namespace}/{dgd_name}")
        if dgd is None:
            return f"DynamoGraphDeployment {dgd_name}"
        entry = GraphDeploymentView(dgd).service(service)
        if entry is None:
            return f"service {service} of {dgd_name}"
        return Found(dgd, service, entry.desired_replicas)

    async def scale(self, found: Found, desired: int) -> None:
        if self.version.converts:
            found = self._indexed(found)
        await _write(self.kube, found, desired, self.version.kind, None)

    def _indexed(self, found: Found) -> Found:
        """``found`` with its component's index in the stored list: the view converted back gives the
        list's order (the conversion keeps it); the patch's test op refuses a stale one."""
        component = StoredGraphDeploymentView(self.version.stored(found.dgd)).component(found.service)
        if component is None:
            name = Meta(found.dgd).name
            raise ScaleFailed("TargetNotFound", f"component {found.service} of {name} does not exist")
        return Found(found.dgd, found.service, found.replicas, index=component.index)

    def pods(self, namespace: str, dgd_name: str, service: str) -> list[Obj]:
        return pods_of(self._pods, namespace, dgd_name, service)


class OperatorDgds:
    """Beside NVIDIA's Dynamo operator: its DGDs (v1beta1 where served), its adapters where their CRD is
    installed, and the pods it labels with the graph and component; every cache read-only and this
    object's own, started by ``open`` from what the cluster's CRDs serve then."""

    def __init__(self, kube: Kube, namespace: str | None) -> None:
        self.kube, self.namespace = kube, namespace
        self.dgd_kind: ResourceKind = DGD
        self.adapter_kind: ResourceKind | None = None
        self.dgds: Informer | None = None
        self.adapters: Informer | None = None
        self._pods: Informer | None = None

    @property
    def informers(self) -> list[Informer]:
        return [i for i in (self.dgds, self.adapters, self._pods) if i is not None]

    async def open(self) -> None:
        dgd_version = read_version(await self._crd(DGD_CRD_NAME)) or _V1ALPHA1
        self.dgd_kind = ResourceKind(DGD.group, dgd_version, DGD.plural, DGD.kind)
        adapter_version = read_version(await self._crd(DGDSA_CRD_NAME))
        self.adapter_kind = adapter_kind(adapter_version) if adapter_version else None
        ns = self.namespace
        self.dgds = Informer(self.kube, self.dgd_kind, namespace=ns)
        if self.adapter_kind is not None:
            self.adapters = Informer(
                self.kube, self.adapter_kind, namespace=ns, indexed_labels=[protocol.LABEL_DYNAMO_GRAPH]
            )
        self._pods = Informer(
            self.kube,
            POD,
            namespace=ns,
            label_selector=protocol.LABEL_DYNAMO_GRAPH,
            indexed_labels=[protocol.LABEL_DYNAMO_GRAPH],
        )
        for informer in self.informers:
            informer.start()
        await asyncio.gather(*(i.wait_synced() for i in self.informers))
        log.info(
            "autoscaler targets beside the Dynamo operator",
            extra={"dgdVersion": dgd_version, "adapterVersion": adapter_version or "none"},
        )

    async def close(self) -> None:
        for informer in self.informers:
            await informer.stop()
        self.dgds = self.adapters = self._pods = None

    async def _crd(self, name: str) -> Obj | None:
        try:
            return await self.kube.get(CRD, name)
        except ApiError as e:
            if not is_not_found(e):
                # Unreadable counts as absent (the DGD is then written itself); the log says why.
                log.warning("cannot read a CRD", extra={"crd": name, "error": str(e)})
            return None

    def find(self, namespace: str, dgd_name: str, service: str) -> Found | str:
        assert self.dgds is not None, "open() first"
        dgd = self.dgds.get(f"{namespace}/{dgd_name}")
        if dgd is None:
            return f"DynamoGraphDeployment {dgd_name}"
        index: int | None = None
        entry: ComponentView | ServiceView | None
        if self.dgd_kind.version == _V1BETA1:
            entry = StoredGraphDeploymentView(dgd).component(service)
            index = entry.index if entry is not None else None
            noun = "component"
        else:
            entry = GraphDeploymentView(dgd).service(service)
            noun = "service"
        if entry is None:
            return f"{noun} {service} of {dgd_name}"
        adapter = self._adapter(namespace, dgd_name, service)
        if adapter is not None:
            return Found(dgd, service, ScalingAdapterView(adapter).replicas, adapter=adapter, index=index)
        return Found(dgd, service, entry.desired_replicas, index=index)

    def _adapter(self, namespace: str, dgd_name: str, service: str) -> Obj | None:
        """The DGDSA whose dgdRef names this DGD and service (v1alpha1's serviceName, v1beta1's
        componentName); found by its dgdRef, not by the operator's naming rule."""
        if self.adapters is None:
            return None
        for adapter in self.adapters.by_label(protocol.LABEL_DYNAMO_GRAPH, dgd_name):
            view = ScalingAdapterView(adapter)
            if (view.meta.namespace, view.dgd_name, view.service_name) == (namespace, dgd_name, service):
                return adapter
        return None

    async def scale(self, found: Found, desired: int) -> None:
        await _write(self.kube, found, desired, self.dgd_kind, self.adapter_kind)

    def pods(self, namespace: str, dgd_name: str, service: str) -> list[Obj]:
        assert self._pods is not None, "open() first"
        return [
            p
            for p in self._pods.by_label(protocol.LABEL_DYNAMO_GRAPH, dgd_name)
            if (meta := Meta(p)).namespace == namespace
            and meta.labels.get(protocol.LABEL_DYNAMO_COMPONENT) == service
        ]


async def _write(
    kube: Kube, found: Found, desired: int, dgd_kind: ResourceKind, adapter: ResourceKind | None
) -> None:
    meta = Meta(found.dgd)
    try:
        if found.adapter is not None and adapter is not None:
            a = Meta(found.adapter)
            scale = await kube.get_scale(adapter, a.name, a.namespace)
            scale["spec"] = {**ObjectView(scale).spec, "replicas": desired}
            await kube.replace_scale(adapter, scale)
        elif found.index is not None:
            at = f"/spec/components/{found.index}"
            ops: list[Obj] = [
                {"op": "test", "path": f"{at}/name", "value": found.service},
                {"op": "add", "path": f"{at}/replicas", "value": desired},
            ]
            await kube.json_patch(dgd_kind, meta.name, ops, meta.namespace)
        else:
            patch = {"spec": {"services": {found.service: {"replicas": desired}}}}
            await kube.merge_patch(dgd_kind, meta.name, patch, meta.namespace)
    except ApiError as e:
        written = adapter if found.adapter is not None and adapter is not None else dgd_kind
        raise _failure(found, e, written) from e


def _failure(found: Found, e: ApiError, kind: ResourceKind) -> ScaleFailed:
    what = found.written
    detail = e.message or e.reason or str(e.status)
    if e.status == 403:
        # What _write calls: the adapter's Scale read and replaced, else the DGD patched.
        needs = (
            f"get and update on {kind.plural}/scale"
            if found.adapter is not None
            else f"patch on {kind.plural}"
        )
        return ScaleFailed(
            "ScaleForbidden",
            f"{what}: the controller may not write it ({detail}); its ClusterRole needs {needs} in group "
            f"{kind.group} (the chart grants them)",
        )
    if e.status == 404:
        return ScaleFailed("TargetNotFound", f"{what} does not exist ({detail})")
    if e.status == 409:
        return ScaleFailed(
            "ScaleConflict", f"{what} changed while it was written ({detail}); tried again next evaluation"
        )
    if e.status == 422 and found.adapter is None and found.index is not None:
        # The apiserver answers a failed `test` op with a bare 422: the patch holds nothing else to refuse.
        return ScaleFailed(
            "ScaleConflict",
            f"{what}: spec.components[{found.index}] is no longer {found.service} (reordered while it was "
            "written); nothing was scaled, tried again next evaluation",
        )
    return ScaleFailed("ScaleFailed", f"{what}: {detail}")
