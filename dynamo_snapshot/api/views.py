"""Typed views over the objects as the apiserver and the informers' caches hold them (plain dicts): each
field is read in one place, with its absence (a missing map, a null list) read as empty, so the code
that decides reads ``pod.meta.uid`` and ``snapshot.bound_content``, not ``(obj.get("status") or {})``.

A view never copies or changes its object: it is a lens, cheap to make on every event. The models in
this package validate what we write and what users write; these read what the cluster holds, which may
be of any shape a newer or older writer gave it, so a wrong type reads as absent rather than raising.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.restore_request import container_map, restore_from

__all__ = [
    "CheckpointView",
    "ContainerRef",
    "ContainerView",
    "Meta",
    "NodeView",
    "ObjectView",
    "PodSnapshotContentView",
    "PodSnapshotView",
    "PodView",
    "SnapshotJobView",
    "still_live",
]

Obj = dict[str, Any]


def _map(value: object) -> Obj:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Meta:
    """An object's metadata."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = _map(raw.get("metadata"))

    @property
    def name(self) -> str:
        return _str(self.raw.get("name"))

    @property
    def namespace(self) -> str:
        return _str(self.raw.get("namespace"))

    @property
    def uid(self) -> str:
        return _str(self.raw.get("uid"))

    @property
    def labels(self) -> Mapping[str, str]:
        return _map(self.raw.get("labels"))

    @property
    def annotations(self) -> Mapping[str, str]:
        return _map(self.raw.get("annotations"))

    @property
    def generate_name(self) -> str:
        return _str(self.raw.get("generateName"))

    @property
    def creation_timestamp(self) -> str:
        return _str(self.raw.get("creationTimestamp"))

    @property
    def resource_version(self) -> str:
        return _str(self.raw.get("resourceVersion"))

    @property
    def finalizers(self) -> list[str]:
        return [f for f in _list(self.raw.get("finalizers")) if isinstance(f, str)]

    @property
    def generation(self) -> int | None:
        return _int(self.raw.get("generation"))

    @property
    def deleting(self) -> bool:
        return bool(self.raw.get("deletionTimestamp"))

    @property
    def owner_references(self) -> list[Obj]:
        """The ownerReferences (their maps, as written), to read or copy onto another object."""
        return [r for r in _list(self.raw.get("ownerReferences")) if isinstance(r, dict)]

    @property
    def owner_uids(self) -> set[str]:
        return {_str(_map(r).get("uid")) for r in _list(self.raw.get("ownerReferences"))} - {""}

    @property
    def controller(self) -> dict[str, str] | None:
        """The controller ownerReference (its string fields), or None: what manages the object."""
        for ref in _list(self.raw.get("ownerReferences")):
            if isinstance(ref, dict) and ref.get("controller"):
                return {k: v for k, v in ref.items() if isinstance(v, str)}
        return None


def _main(entries: list[Obj], name: str | None = None) -> Obj | None:
    """The entry of container ``name``; without a name, the one called main, else the first."""
    if name is not None:
        return next((e for e in entries if e.get("name") == name), None)
    named = (e for e in entries if e.get("name") == protocol.DEFAULT_TARGET_CONTAINER)
    return next(named, entries[0] if entries else None)


def still_live(latest: Mapping[str, Any] | None, seen: Mapping[str, Any]) -> bool:
    """Whether ``latest`` (a cache's copy, None: gone) is still the object ``seen`` was (same UID) and is
    not being deleted."""
    return latest is not None and Meta(latest).uid == Meta(seen).uid and not Meta(latest).deleting


class ObjectView:
    """Any object: its metadata, spec, status and conditions."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.meta = Meta(raw)

    @property
    def spec(self) -> Obj:
        return _map(self.raw.get("spec"))

    @property
    def status(self) -> Obj:
        return _map(self.raw.get("status"))

    @property
    def conditions(self) -> list[Obj]:
        """A copy of ``status.conditions`` (its maps), to change and write back."""
        return [c for c in _list(self.status.get("conditions")) if isinstance(c, dict)]

    def condition(self, type_: str) -> Obj:
        """The condition of ``type_`` in ``status.conditions``; empty when there is none."""
        for c in _list(self.status.get("conditions")):
            if isinstance(c, dict) and c.get("type") == type_:
                return c
        return {}

    def condition_true(self, type_: str) -> bool:
        return self.condition(type_).get("status") == "True"


class PodView(ObjectView):
    @property
    def node_name(self) -> str:
        return _str(self.spec.get("nodeName"))

    @property
    def phase(self) -> str:
        return _str(self.status.get("phase"))

    @property
    def reason(self) -> str:
        """``status.reason`` (e.g. Evicted)."""
        return _str(self.status.get("reason"))

    @property
    def start_time(self) -> str:
        """``status.startTime``: when the kubelet took the pod on."""
        return _str(self.status.get("startTime"))

    @property
    def finished(self) -> bool:
        """Its phase is Succeeded or Failed: it runs nothing any more."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def start_mode(self) -> str:
        """How the controller started it (label ``snapshot.nvidia.com/start-mode``): cold when unlabelled."""
        return str(self.meta.labels.get(protocol.LABEL_START_MODE, protocol.StartMode.COLD.value))

    @property
    def init_container_statuses(self) -> list[Obj]:
        return [s for s in _list(self.status.get("initContainerStatuses")) if isinstance(s, dict)]

    @property
    def pod_ip(self) -> str:
        return _str(self.status.get("podIP"))

    @property
    def container_statuses(self) -> list[Obj]:
        return [s for s in _list(self.status.get("containerStatuses")) if isinstance(s, dict)]

    @property
    def containers(self) -> list[Obj]:
        return [c for c in _list(self.spec.get("containers")) if isinstance(c, dict)]

    @property
    def container_names(self) -> list[str]:
        return [_str(_map(c).get("name")) for c in _list(self.spec.get("containers"))]

    @property
    def target_container(self) -> str | None:
        """The container the pod itself names as the one checkpointed or restored into:
        restore-container-map's first destination, else the first of snapshot-target-containers; None
        where it names none (``main_container``'s rule then applies)."""
        mapping = self.container_map
        if mapping is not None:
            try:
                return container_map(mapping)[1][0]
            except ValueError:
                pass
        listed = _str(self.meta.annotations.get(protocol.ANNOTATION_TARGET_CONTAINERS))
        first = listed.split(",")[0].strip()
        return first or None

    @property
    def restore_targets(self) -> tuple[str, ...]:
        """Every container the pod asks a restore into, as written: restore-container-map's destinations,
        else the main container alone (an unreadable map too: the restore is refused with its reason)."""
        mapping = self.container_map
        if mapping is not None:
            try:
                return container_map(mapping)[1]
            except ValueError:
                pass
        return (self.main_name,)

    @property
    def main_container(self) -> Obj | None:
        """The container a worker runs in: the one ``target_container`` names, else the one called main,
        else the first; None without any (or without the one named)."""
        return _main(self.containers, self.target_container)

    @property
    def main_status(self) -> Obj | None:
        """The main container's status (``main_container``'s rule)."""
        return _main(self.container_statuses, self.target_container)

    @property
    def main_name(self) -> str:
        """The main container's name (main where the pod has none)."""
        return _str(_map(self.main_container).get("name")) or protocol.DEFAULT_TARGET_CONTAINER

    def status_of(self, name: str) -> Obj | None:
        """The kubelet's status of container ``name``."""
        return _main(self.container_statuses, name)

    def container(self, name: str) -> ContainerView | None:
        """The container called ``name``, with the kubelet's status of it; None where the spec has none."""
        spec = next((c for c in self.containers if c.get("name") == name), None)
        if spec is None:
            return None
        return ContainerView(spec, self.status_of(name))

    @property
    def restore_from(self) -> str | None:
        """``nvidia.com/restore-from`` as written (``api.restore_request``); None when not there."""
        return restore_from(self.meta.annotations)

    @property
    def container_map(self) -> str | None:
        value = self.meta.annotations.get(protocol.ANNOTATION_RESTORE_CONTAINER_MAP)
        return None if value is None else str(value)


class ContainerView:
    """One container of a pod: its spec, and the kubelet's status of it (empty before it reports one)."""

    def __init__(self, spec: object, status: object) -> None:
        self.spec = _map(spec)
        self.status = _map(status)

    @property
    def name(self) -> str:
        return _str(self.spec.get("name"))

    @property
    def image(self) -> str:
        """The image reference the spec names (a tag may name another build tomorrow)."""
        return _str(self.spec.get("image"))

    @property
    def image_id(self) -> str:
        """The image the container runs as the kubelet reports it: by digest where the runtime gives one."""
        return _str(self.status.get("imageID"))

    def limit(self, resource: str) -> str:
        """``resources.limits[resource]`` as a quantity string; empty without that limit."""
        value = _map(_map(self.spec.get("resources")).get("limits")).get(resource)
        # The apiserver returns quantities as strings; a hand-made object may hold a whole number.
        number = _int(value)
        return str(number) if number is not None else _str(value)


class ContainerRef:
    """A pod and its containers as a PodSnapshot or its content names them (``podRef``)."""

    def __init__(self, raw: object) -> None:
        self.raw = _map(raw)

    @property
    def name(self) -> str:
        return _str(self.raw.get("name"))

    @property
    def uid(self) -> str:
        return _str(self.raw.get("uid"))

    @property
    def containers(self) -> list[str]:
        return [str(c) for c in _list(self.raw.get("containers"))]


class PodSnapshotView(ObjectView):
    @property
    def source(self) -> ContainerRef:
        return ContainerRef(_map(self.spec.get("source")).get("podRef"))

    @property
    def bound_content(self) -> str:
        return _str(self.status.get("boundSnapshotContentName"))


class PodSnapshotContentView(ObjectView):
    @property
    def snapshot_ref(self) -> Obj:
        """The PodSnapshot the content is of: ``namespace``, ``name`` and ``uid`` (empty where absent)."""
        return _map(self.spec.get("snapshotRef"))

    @property
    def source_node(self) -> str:
        return _str(_map(self.spec.get("source")).get("nodeName"))

    @property
    def source(self) -> ContainerRef:
        return ContainerRef(_map(self.spec.get("source")).get("podRef"))


class CheckpointView(ObjectView):
    """A DynamoCheckpoint."""

    @property
    def phase(self) -> str:
        return _str(self.status.get("phase"))

    @property
    def pod_snapshot_name(self) -> str:
        return _str(self.status.get("podSnapshotName"))

    @property
    def artifact_digest(self) -> str:
        return _str(self.status.get("artifactDigest"))

    @property
    def identity(self) -> object:
        return self.spec.get("identity")


class SnapshotJobView(ObjectView):
    """A SnapshotJob: its pod template, and what its reconcile made (as its status records it)."""

    @property
    def pod_template(self) -> Obj:
        return _map(self.spec.get("podTemplate"))

    @property
    def source_job_uid(self) -> str:
        return _str(self.status.get("sourceJobUid"))

    @property
    def pod_snapshot_name(self) -> str:
        return _str(self.status.get("podSnapshotName"))

    @property
    def pod_snapshot_uid(self) -> str:
        return _str(self.status.get("podSnapshotUid"))

    @property
    def started_at(self) -> str:
        return _str(self.status.get("startedAt"))


class NodeView(ObjectView):
    """A Node, as far as worker failover reads its health."""

    @property
    def ready(self) -> str | None:
        """Its Ready condition's status ("True", "False", "Unknown"); None without a Ready condition."""
        found = self.condition("Ready")
        return _str(found.get("status")) if found else None

    @property
    def taints(self) -> list[Obj]:
        return [t for t in _list(self.spec.get("taints")) if isinstance(t, dict)]

    @property
    def unschedulable(self) -> bool:
        """Cordoned (``spec.unschedulable``)."""
        return bool(self.spec.get("unschedulable"))
