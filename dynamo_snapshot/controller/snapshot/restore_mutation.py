"""What the restore webhook does to a pod created with ``nvidia.com/restore-from``: pure, over the pod and
the objects the server looked up in the pod's namespace; the answer is JSON Patch operations and
warnings, or a denial.

A pod is shaped so that the node agent can restore into it and nothing cold-starts by mistake: the
control volume, mount and variables on each target container (every destination of
``nvidia.com/restore-container-map``), the standby variables (the image's
entrypoint waits as the restore placeholder), the restore-target and checkpoint-id labels, a readiness
gate on the ``nvidia.com/Restored`` condition the node agent writes, and required node affinity to the
nodes the captured GPU state fits. Shaping is idempotent: a pod that is shaped already (the controller's
own DGD restore pods) gets no duplicate entries and, when nothing is missing, no patch at all.

A request that cannot be right is denied (a name of another namespace or no valid name, a malformed
``nvidia.com/restore-container-map``, a pod without the target container). A snapshot that is missing
or not Ready yet is admitted with a warning, still shaped to standby: the node agent then reports why
the restore does not happen on the pod's ``nvidia.com/Restored`` condition.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility, CheckpointPhase
from dynamo_snapshot.api.conditions import READY, validation_message
from dynamo_snapshot.api.podsnapshot import PodSnapshotCompatibility, content_compatibility
from dynamo_snapshot.api.restore_request import name_problem, restore_destinations
from dynamo_snapshot.api.views import CheckpointView, PodSnapshotContentView, PodSnapshotView, PodView
from dynamo_snapshot.controller.podspec import (
    add_restore_standby,
    add_snapshot_control,
    compatibility_affinity,
    require_node_affinity,
)

__all__ = [
    "Found",
    "Outcome",
    "mutate",
    "name_problem",
    "requested_name",
]

Obj = dict[str, Any]

# What a pod that is not restored is told, after why: it waits, it is not cold-started.
_STANDBY = (
    f"the pod waits as a restore placeholder; the node agent reports {protocol.POD_CONDITION_RESTORED}=False"
)


@dataclass(frozen=True)
class Found:
    """What ``nvidia.com/restore-from`` names, read in the pod's namespace (None: not there): a
    DynamoCheckpoint, else a PodSnapshot and the PodSnapshotContent it is bound to."""

    checkpoint: Obj | None = None
    snapshot: Obj | None = None
    content: Obj | None = None


@dataclass(frozen=True)
class Outcome:
    """``denied`` (the message) or admitted with ``patch`` (empty: unchanged) and ``warnings``."""

    patch: list[Obj] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    denied: str | None = None
    targets: tuple[str, ...] = ()


def requested_name(pod: Obj) -> str | None:
    """The value of ``nvidia.com/restore-from``; None when the pod has no such annotation."""
    return PodView(pod).restore_from


def _captured(found: Found) -> str | None:
    """The container the named object captured; None when nothing of the name was found."""
    if found.checkpoint is not None:
        # A DynamoCheckpoint's Job captures the worker's main container.
        return protocol.DEFAULT_TARGET_CONTAINER
    if found.snapshot is not None:
        containers = PodSnapshotView(found.snapshot).source.containers
        return containers[0] if containers else None
    return None


def _targets(pod: Obj, found: Found) -> tuple[str, ...]:
    """The containers to restore into; ValueError with the reason when the request cannot be right."""
    return restore_destinations(PodView(pod).container_map, _captured(found))


def _checkpoint_state(name: str, ckpt: Obj) -> tuple[str | None, CheckpointCompatibility | None]:
    """(warning, compatibility) of a DynamoCheckpoint: a warning unless it can be restored now."""
    view = CheckpointView(ckpt)
    if view.meta.deleting:
        return f"DynamoCheckpoint {name!r} is being deleted", None
    if view.phase != CheckpointPhase.READY.value:
        return f"DynamoCheckpoint {name!r} is not Ready (phase {view.phase or 'Pending'})", None
    compatibility = view.status.get("compatibility")
    if not compatibility:
        return None, None
    try:
        return None, CheckpointCompatibility.model_validate(compatibility)
    except ValidationError as e:
        return f"DynamoCheckpoint {name!r} has an unreadable compatibility ({validation_message(e)})", None


def _snapshot_state(name: str, found: Found) -> tuple[str | None, PodSnapshotCompatibility | None]:
    """(warning, compatibility) of a PodSnapshot and its content: a warning unless it can be restored now."""
    snapshot = PodSnapshotView(found.snapshot or {})
    if snapshot.meta.deleting:
        return f"PodSnapshot {name!r} is being deleted", None
    if not snapshot.condition_true(READY):
        ready = snapshot.condition(READY)
        why = ready.get("message") or ready.get("reason") or "not captured yet"
        return f"PodSnapshot {name!r} is not Ready ({why})", None
    content = found.content
    if content is None or PodSnapshotContentView(content).snapshot_ref.get("uid") != snapshot.meta.uid:
        return f"PodSnapshot {name!r} has no PodSnapshotContent bound to it", None
    try:
        return None, content_compatibility(content)
    except ValueError as e:
        return f"PodSnapshot {name!r}'s content: {e}", None


def _dedupe_affinity(spec: Obj) -> None:
    """Each required node-selector term lists an expression once, however often the pod was shaped."""
    terms = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    ).get("nodeSelectorTerms") or []
    for term in terms:
        unique: list[Obj] = []
        for expr in term.get("matchExpressions") or []:
            if expr not in unique:
                unique.append(expr)
        if "matchExpressions" in term:
            term["matchExpressions"] = unique


def _escape(key: str) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _json_patch(before: Obj, after: Obj) -> list[Obj]:
    """The operations that turn ``before`` into ``after`` over the fields shaping touches: labels and
    annotations one key at a time, containers one at a time, the other lists and the affinity whole."""
    ops: list[Obj] = []
    for part in ("labels", "annotations"):
        old_map = (before.get("metadata") or {}).get(part)
        new_map = after["metadata"][part]
        if old_map is None:
            ops.append({"op": "add", "path": f"/metadata/{part}", "value": new_map})
            continue
        for key, value in new_map.items():
            if old_map.get(key) != value:
                ops.append({"op": "add", "path": f"/metadata/{part}/{_escape(key)}", "value": value})
    old_spec, new_spec = before.get("spec") or {}, after["spec"]
    pairs = zip(old_spec.get("containers") or [], new_spec["containers"], strict=True)
    for i, (old, new) in enumerate(pairs):
        if old != new:
            ops.append({"op": "replace", "path": f"/spec/containers/{i}", "value": new})
    for name in ("volumes", "readinessGates", "affinity"):
        if name in new_spec and old_spec.get(name) != new_spec[name]:
            ops.append({"op": "add", "path": f"/spec/{name}", "value": new_spec[name]})
    return ops


def _state(name: str, namespace: str, found: Found) -> tuple[str | None, Any]:
    if found.checkpoint is not None:
        return _checkpoint_state(name, found.checkpoint)
    if found.snapshot is not None:
        return _snapshot_state(name, found)
    return f"no DynamoCheckpoint or PodSnapshot named {name!r} in namespace {namespace}", None


def mutate(pod: Obj, namespace: str, found: Found) -> Outcome:
    """The webhook's answer for a pod of ``namespace`` being created, given what its
    ``nvidia.com/restore-from`` names (``found``, read in that namespace)."""
    name = requested_name(pod)
    if name is None:
        return Outcome()
    problem = name_problem(name, namespace)
    if problem:
        return Outcome(denied=problem)
    try:
        targets = _targets(pod, found)
    except ValueError as e:
        return Outcome(denied=str(e))
    names = PodView(pod).container_names
    missing = [target for target in targets if target not in names]
    if missing:
        return Outcome(
            denied=f"the pod has no container {missing[0]!r} to restore into (it has "
            f"{', '.join(names) or 'none'}): rename it, or map the captured container onto one with "
            f"{protocol.ANNOTATION_RESTORE_CONTAINER_MAP}"
        )
    warning, compat = _state(name, namespace, found)
    shaped = copy.deepcopy(pod)
    spec = shaped.setdefault("spec", {})
    for target in targets:
        add_snapshot_control(spec, target)
        add_restore_standby(spec, target)
    labels = shaped.setdefault("metadata", {}).get("labels") or {}
    shaped["metadata"]["labels"] = {
        **labels,
        protocol.LABEL_RESTORE_TARGET: protocol.TRUE,
        protocol.LABEL_CHECKPOINT_ID: name,
    }
    # The containers the node agent restores into, said on the pod itself (the captured container's
    # name is the PodSnapshot's, which the agent reads only with the grant).
    annotations = shaped["metadata"].get("annotations") or {}
    shaped["metadata"]["annotations"] = {
        **annotations,
        protocol.ANNOTATION_TARGET_CONTAINERS: ",".join(targets),
    }
    gates = list(spec.get("readinessGates") or [])
    if not any(g.get("conditionType") == protocol.POD_CONDITION_RESTORED for g in gates):
        spec["readinessGates"] = [*gates, {"conditionType": protocol.POD_CONDITION_RESTORED}]
    require_node_affinity(spec, compatibility_affinity(compat))
    _dedupe_affinity(spec)
    warnings = [f"{warning}: {_STANDBY}"] if warning else []
    return Outcome(patch=_json_patch(pod, shaped), warnings=warnings, targets=targets)
