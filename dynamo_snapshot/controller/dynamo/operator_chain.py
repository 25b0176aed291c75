"""Which pods of NVIDIA's Dynamo operator may be failed over by restore: the proof that a pod is the
operator's (its controller chain, read from the apiserver) and the Ready checkpoint its owner's next pod
restores from (read from the caches of the pod's own namespace). Pure but for `controller_chain`'s reads.

Dynamo's operator (ai-dynamo/dynamo deploy/operator) makes a DGD's pods through a DynamoComponentDeployment
and a Deployment (ReplicaSet), through a LeaderWorkerSet (StatefulSets) for multi-node components, or
through Grove (PodCliqueSet, PodCliqueScalingGroup, PodClique). A pod's labels are only a claim: a pod is
the operator's only when its controller ownerReferences lead, object by object, each present in the pod's
namespace with the UID the reference names, to the DynamoGraphDeployment its
nvidia.com/dynamo-graph-deployment-name label names, through no kind outside that list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointPhase
from dynamo_snapshot.api.restore_request import name_problem, restore_from
from dynamo_snapshot.api.views import CheckpointView, Meta, ObjectView, PodSnapshotView, SnapshotJobView
from dynamo_snapshot.kube import Kube, Obj, ResourceKind, controller_ref, is_not_found
from dynamo_snapshot.kube.kinds import CHECKPOINT, DGD, POD_SNAPSHOT, SNAPSHOT_JOB

__all__ = [
    "CHAIN_MAX",
    "Chain",
    "checkpoint_of",
    "controller_chain",
    "next_pod_annotations",
]

# (API group, kind) of the controllers that create the operator's pods, and of the objects above them.
POD_CREATORS = frozenset({("apps", "ReplicaSet"), ("apps", "StatefulSet"), ("grove.io", "PodClique")})
_ABOVE = frozenset(
    {
        ("apps", "Deployment"),
        ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"),
        ("grove.io", "PodCliqueScalingGroup"),
        ("grove.io", "PodCliqueSet"),
        ("nvidia.com", "DynamoComponentDeployment"),
        (DGD.group, DGD.kind),
    }
)
# The longest chain: Pod <- PodClique <- PodCliqueScalingGroup <- PodCliqueSet <- DGD, with a margin.
CHAIN_MAX = 6

Get = Callable[[ResourceKind, str], Obj | None]


@dataclass(frozen=True)
class Chain:
    """A pod proven the operator's: the controller that creates its successor, and its DGD."""

    creator: Obj
    dgd: Obj

    def describe(self) -> str:
        return f"{self.creator['kind']} {Meta(self.creator).name}"


def _kind_of(ref: Mapping[str, str], allowed: frozenset[tuple[str, str]]) -> ResourceKind | None:
    group, _, version = ref.get("apiVersion", "").rpartition("/")
    kind = ref.get("kind", "")
    if (group, kind) not in allowed or not version:
        return None
    return ResourceKind(group, version, f"{kind.lower()}s", kind)


async def controller_chain(kube: Kube, pod: Obj) -> Chain | str:
    """The pod's controller chain up to its DGD, read from the apiserver; else why it is not the
    operator's (a sentence)."""
    meta = Meta(pod)
    namespace = meta.namespace
    graph = meta.labels.get(protocol.LABEL_DYNAMO_GRAPH)
    obj, chain = pod, []
    allowed = POD_CREATORS
    for _ in range(CHAIN_MAX):
        ref = controller_ref(obj)
        what = f"{obj.get('kind', 'Pod')} {Meta(obj).name}"
        if ref is None:
            return f"{what} has no controller"
        kind = _kind_of(ref, allowed)
        if kind is None:
            return (
                f"{what} is controlled by {ref.get('kind')} {ref.get('name')} ({ref.get('apiVersion')}), "
                "not by a kind Dynamo's operator makes pods through"
            )
        try:
            found = await kube.get(kind, ref["name"], namespace)
        except Exception as e:
            if not is_not_found(e):
                raise
            return f"{what}'s controller {kind.kind} {ref['name']} is not in namespace {namespace}"
        if Meta(found).uid != ref.get("uid", ""):
            return f"{what}'s controller {kind.kind} {ref['name']} in {namespace} has another UID"
        chain.append(found)
        if (kind.group, kind.kind) == (DGD.group, DGD.kind):
            if Meta(found).name != graph:
                return (
                    f"pod {meta.name} is labelled {protocol.LABEL_DYNAMO_GRAPH}={graph} but belongs "
                    f"to DynamoGraphDeployment {Meta(found).name}"
                )
            return Chain(creator=chain[0], dgd=found)
        obj, allowed = found, _ABOVE
    return f"pod {meta.name}: no DynamoGraphDeployment within {CHAIN_MAX} controllers"


def next_pod_annotations(chain: Chain, pod: Obj) -> Mapping[str, str]:
    """The annotations the creator's next pod is created with: its pod template's, else (a Grove PodClique
    holds no template metadata; it copies its pods' from the PodCliqueSet) the lost pod's own."""
    template = ObjectView(chain.creator).spec.get("template")
    if isinstance(template, dict):
        return Meta(template).annotations
    return Meta(pod).annotations


def checkpoint_of(namespace: str, annotations: Mapping[str, str], get: Get) -> tuple[str | None, str]:
    """The Ready checkpoint of `namespace` a pod created with `annotations` restores from, described
    ("PodSnapshot x"), and ""; or None and why there is none.

    nvidia.com/restore-from names a DynamoCheckpoint, else a PodSnapshot (as the node agent resolves it);
    Dynamo's restore-candidate annotations name a PodSnapshot, or the SnapshotJob producing one. `get`
    reads an object of the namespace by kind and name (None: not there)."""
    asked = restore_from(annotations)
    candidate = annotations.get(protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE) == protocol.TRUE
    kinds: tuple[ResourceKind, ...]
    if asked is not None:
        problem = name_problem(asked, namespace)
        if problem:
            return None, problem
        name, kinds = asked, (CHECKPOINT, POD_SNAPSHOT)
    elif candidate and annotations.get(protocol.ANNOTATION_DYNAMO_CHECKPOINT_NAME, "").strip():
        name = annotations[protocol.ANNOTATION_DYNAMO_CHECKPOINT_NAME].strip()
        source = annotations.get(protocol.ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND) or POD_SNAPSHOT.kind
        by_kind = {POD_SNAPSHOT.kind: (POD_SNAPSHOT,), SNAPSHOT_JOB.kind: (SNAPSHOT_JOB,)}
        if source not in by_kind:
            return None, (
                f"{protocol.ANNOTATION_DYNAMO_RESTORE_SOURCE_KIND}={source!r} is neither "
                f"{POD_SNAPSHOT.kind} nor {SNAPSHOT_JOB.kind}"
            )
        kinds = by_kind[source]
    else:
        return None, (
            f"its pods are not restore pods (no {protocol.ANNOTATION_RESTORE_FROM}, no "
            f"{protocol.ANNOTATION_DYNAMO_RESTORE_CANDIDATE}=true with a checkpoint name)"
        )
    for kind in kinds:
        obj = get(kind, name)
        if obj is not None:
            return _ready(kind, obj, get)
    return None, f"{' or '.join(k.kind for k in kinds)} {name} is not in namespace {namespace}"


def _ready(kind: ResourceKind, obj: Obj, get: Get) -> tuple[str | None, str]:
    what = f"{kind.kind} {Meta(obj).name}"
    if kind == CHECKPOINT:
        phase = CheckpointView(obj).phase or CheckpointPhase.PENDING.value
        return (what, "") if phase == CheckpointPhase.READY.value else (None, f"{what} is {phase}")
    if kind == SNAPSHOT_JOB:
        job = SnapshotJobView(obj)
        snapshot = job.pod_snapshot_name
        found = get(POD_SNAPSHOT, snapshot) if snapshot else None
        if found is None:
            return None, f"{what} has produced no PodSnapshot yet"
        if job.pod_snapshot_uid not in ("", Meta(found).uid):
            return None, f"{what}'s PodSnapshot {snapshot} was replaced by another of the same name"
        return _ready(POD_SNAPSHOT, found, get)
    snapshot_view = PodSnapshotView(obj)
    if snapshot_view.condition_true(cond.READY) and snapshot_view.bound_content:
        return what, ""
    return None, f"{what} is not Ready"
