"""What every reconciler shares: the client, every informer cache of both layers, the event recorder, the
expectations and the settings. Reads go to the caches (level-triggered, never to memory that a restart
would lose)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cachetools import TTLCache
from prometheus_client import Counter, Histogram

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility
from dynamo_snapshot.api.views import Meta, NodeView
from dynamo_snapshot.controller.config import CONTROLLER_NAME, ControllerConfig
from dynamo_snapshot.controller.expectations import Expectations
from dynamo_snapshot.controller.failover.losses import PAUSED, Failover
from dynamo_snapshot.controller.failover.node_state import node_down, unhealthy_since
from dynamo_snapshot.controller.podspec import keep_off_nodes
from dynamo_snapshot.kube import EventRecorder, Informer, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot.kube.informer import compact
from dynamo_snapshot.kube.kinds import (
    CHECKPOINT,
    JOB,
    NODE,
    POD,
    POD_SNAPSHOT,
    POD_SNAPSHOT_CONTENT,
    SNAPSHOT_JOB,
)
from dynamo_snapshot.kube.pods import pods_of

PODS_CREATED = Counter(
    "dynsnap_worker_pods_created_total", "Worker pods created, by how they start", ["mode"]
)
SCALE_TO_POD = Histogram(
    "dynsnap_scale_request_to_pod_created_seconds",
    "From the DGD change that asked for more replicas being observed to the new pod existing",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
# kube-controller-manager treats a zone as unhealthy only from 3 NotReady nodes up (or when none is
# Ready): below that, a share of a tiny cluster says little about the control plane.
UNHEALTHY_NODES_MINIMUM = 3
# At most this many NotReady nodes are written into a new pod's required node affinity (newest first, the
# scheduler's own not-ready/unreachable taints are likelier to be on the older ones), to keep pods small.
AVOIDED_NODES_MAX = 32


@dataclass(frozen=True)
class NodeHealth:
    """The nodes' health as the node cache says it."""

    total: int
    # NotReady or unreachable nodes -> since when, newest first
    down: dict[str, datetime]
    # why failover for node causes is paused (too many nodes down at once); None when it is not
    paused: str | None


@dataclass(kw_only=True)
class Context:
    kube: Kube
    recorder: EventRecorder
    # The Dynamo layer's kinds. DGDs are cached as views (v1alpha1's shape) of `dgd_version`.
    dgds: Informer
    checkpoints: Informer
    # The generic layer's kinds; contents are cluster-scoped.
    snapshots: Informer
    contents: Informer
    snapshot_jobs: Informer
    # What this controller made (label managed-by): worker and capture pods, and the SnapshotJobs' Jobs.
    pods: Informer
    jobs: Informer
    nodes: Informer
    # Mode dynamo-operator: the operator's pods of Dynamo components, which operator failover watches.
    component_pods: Informer
    # The process's own config, not a copy: what the reconcilers read is what the file and flags said.
    settings: ControllerConfig = field(default_factory=ControllerConfig)
    # The version `dgds` reads and the status writes go to; its cache holds views (dgd_versions).
    dgd_version: DgdVersion = field(default_factory=DgdVersion)
    expectations: Expectations = field(default_factory=Expectations)
    failover: Failover = field(default_factory=Failover)
    # Bridges informer lag right after we create a DynamoCheckpoint, so a second reconcile does not
    # look for it by hash and create another one under a different name.
    recent_checkpoints: TTLCache[tuple[str, str, str], str] = field(
        default_factory=lambda: TTLCache(maxsize=10_000, ttl=30.0)
    )
    # Node-compatibility answers change only when nodes change; a short TTL spares a scan per replica.
    compatible_node_cache: TTLCache[tuple[str, str, int], int] = field(
        default_factory=lambda: TTLCache(maxsize=1_024, ttl=5.0)
    )
    dgd_seen_at: dict[str, float] = field(default_factory=dict)
    # DGD key -> the resourceVersion our last status write replaced. While the cache still holds that
    # version, another status write could only conflict (see dynamo.dgd_status.write_status).
    status_written_over: dict[str, str] = field(default_factory=dict)
    # When each DGD's status was last written, to pace writes that carry no new generation.
    status_written_at: dict[str, float] = field(default_factory=dict)
    # Built from the node cache when first asked; `node_changed` drops it.
    _node_health: NodeHealth | None = field(default=None, init=False, repr=False)
    # Unhealthy nodes whose status says since when by neither condition nor taint: when first seen so.
    _down_seen: dict[str, datetime] = field(default_factory=dict, init=False, repr=False)
    # Nodes still down when a pause of failover ended -> then: their grace starts over from then.
    _grace_restarted: dict[str, datetime] = field(default_factory=dict, init=False, repr=False)
    _paused: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        # One set of settings: the failover brakes read the same config as everything else.
        self.failover.settings = self.settings

    @classmethod
    def for_controller(cls, kube: Kube, config: ControllerConfig, dgd_version: DgdVersion) -> Context:
        """Every informer the controller uses, in `config.namespace` (nodes and contents: cluster-wide);
        none is started here (`Controller.informers` says which run in the install mode)."""
        ns = config.namespace
        managed = f"{protocol.LABEL_MANAGED_BY}={protocol.MANAGED_BY_VALUE}"
        return cls(
            kube=kube,
            recorder=EventRecorder(kube, CONTROLLER_NAME),
            dgds=_dgd_informer(kube, dgd_version, ns),
            checkpoints=Informer(
                kube, CHECKPOINT, namespace=ns, indexed_labels=[protocol.LABEL_CHECKPOINT_HASH]
            ),
            snapshots=Informer(kube, POD_SNAPSHOT, namespace=ns),
            contents=Informer(kube, POD_SNAPSHOT_CONTENT),
            # Their Jobs and pods come through the managed-by informers below.
            snapshot_jobs=Informer(kube, SNAPSHOT_JOB, namespace=ns),
            pods=Informer(
                kube,
                POD,
                namespace=ns,
                label_selector=managed,
                indexed_labels=[
                    protocol.LABEL_GRAPH,
                    protocol.LABEL_CHECKPOINT_ID,
                    protocol.LABEL_SNAPSHOT_JOB_UID,
                ],
            ),
            jobs=Informer(kube, JOB, namespace=ns, label_selector=managed),
            nodes=Informer(kube, NODE),
            component_pods=Informer(
                kube,
                POD,
                namespace=ns,
                label_selector=protocol.LABEL_DYNAMO_COMPONENT,
                indexed_labels=[protocol.LABEL_DYNAMO_GRAPH],
            ),
            settings=config,
            dgd_version=dgd_version,
        )

    def pods_of(self, namespace: str, graph: str, service: str | None = None) -> list[Obj]:
        return pods_of(self.pods, namespace, graph, service)

    def checkpoint_by_hash(self, namespace: str, identity_hash: str, dgd_uid: str) -> Obj | None:
        """The checkpoint a DGD's Auto-mode service with `identity_hash` uses: one the DGD owns, or one a
        user made in the namespace (pre-warmed, owned by no DGD). Another DGD's checkpoint never counts."""
        found = [
            c
            for c in self.checkpoints.by_label(protocol.LABEL_CHECKPOINT_HASH, identity_hash)
            if Meta(c).namespace == namespace and usable_by_dgd(c, dgd_uid)
        ]
        if found:
            # Deterministic choice when a user pre-warmed one under another name: the oldest wins.
            return min(found, key=lambda c: (Meta(c).creation_timestamp, Meta(c).name))
        name = self.recent_checkpoints.get((namespace, identity_hash, dgd_uid))
        return self.checkpoints.get(f"{namespace}/{name}") if name else None

    def compatible_nodes(self, compat: CheckpointCompatibility | None) -> int:
        """Ready, schedulable nodes whose GPUs fit the checkpoint."""
        # A checkpoint that states no requirement fits the same nodes as one whose fields are all empty.
        key = (
            (compat.gpu_product or "", compat.cuda_driver_major or "", compat.gpu_count or 0)
            if compat is not None
            else ("", "", 0)
        )
        cached = self.compatible_node_cache.get(key)
        if cached is not None:
            return cached
        count = sum(1 for _ in self._fitting(compat))
        self.compatible_node_cache[key] = count
        return count

    def other_compatible_node(self, compat: CheckpointCompatibility | None, exclude: set[str]) -> bool:
        """Whether a Ready node outside `exclude` fits the checkpoint."""
        return any(Meta(n).name not in exclude for n in self._fitting(compat))

    def _fitting(self, compat: CheckpointCompatibility | None) -> Iterator[Obj]:
        # The one node filter both questions share, so they cannot disagree about which nodes count.
        return (n for n in self.nodes.list() if node_fits(n, compat))

    def compatible_nodes_in_grace(self, compat: CheckpointCompatibility | None) -> dict[str, datetime]:
        """Schedulable nodes whose GPUs fit the checkpoint that are NotReady or unreachable but whose
        workers still count (inside the node grace, or kept while failover is paused) -> when their
        grace ends: nodes a restore waits for rather than starting cold."""
        now = datetime.now(UTC)
        paused = self.node_health().paused is not None
        found = {}
        for node in self.nodes.list():
            if not node_down(node) or NodeView(node).unschedulable or not gpus_fit(node, compat):
                continue
            ends = self.node_grace_ends(node, now)
            if ends > now or paused:
                found[Meta(node).name] = ends
        return found

    # ------------------------------------------------------------------ node health
    def node_changed(self) -> None:
        """A node was added or removed, or its health changed: recount on the next ask."""
        self._node_health = None

    def node_health(self) -> NodeHealth:
        if self._node_health is None:
            self._node_health = self._count_nodes(datetime.now(UTC))
        return self._node_health

    def down_since(self, node: Obj, now: datetime) -> datetime:
        """When an unhealthy node went down: by its own record, else when this controller first saw it."""
        since = unhealthy_since(node)
        if since is not None:
            return since
        return self._down_seen.setdefault(Meta(node).name, now)

    def node_grace_ends(self, node: Obj, now: datetime) -> datetime:
        """When the workers of this unhealthy node count as lost: the grace counts from when it went down,
        or from when failover resumed if it was still down then (which `node_health` notes: ask it first)."""
        since = self.down_since(node, now)
        since = max(since, self._grace_restarted.get(Meta(node).name, since))
        return since + timedelta(seconds=self.settings.node_loss_grace_seconds)

    def keep_off_bad_nodes(self, spec: Obj, avoid: list[str]) -> None:
        """Keep a new pod off the nodes that are NotReady or unreachable now (required), and preferably
        off `avoid` (nodes that just lost workers, which may be failing in ways their status does not
        show yet)."""
        down = list(self.node_health().down)[:AVOIDED_NODES_MAX]
        keep_off_nodes(spec, down, required=True)
        keep_off_nodes(spec, sorted(set(avoid) - set(down)), required=False)

    def _count_nodes(self, now: datetime) -> NodeHealth:
        nodes = self.nodes.list()
        down = {Meta(n).name: self.down_since(n, now) for n in nodes if node_down(n)}
        for gone in set(self._down_seen) - set(down):
            del self._down_seen[gone]
        for gone in set(self._grace_restarted) - set(down):
            del self._grace_restarted[gone]
        newest_first = dict(sorted(down.items(), key=lambda kv: kv[1], reverse=True))
        threshold = self.settings.unhealthy_nodes_threshold
        paused = None
        if down and (
            len(down) == len(nodes)
            or (len(down) >= UNHEALTHY_NODES_MINIMUM and len(down) / len(nodes) >= threshold)
        ):
            paused = (
                f"{len(down)} of {len(nodes)} nodes are NotReady or unreachable (pause threshold "
                f"{threshold:.0%}, at least {UNHEALTHY_NODES_MINIMUM} or all nodes): more likely a "
                "control-plane or network outage than failed nodes, so their workers are not replaced"
            )
        if self._paused and paused is None:
            # Nodes come back one by one after an outage: the first back lifts the pause while the others'
            # heartbeats are still on their way, all long past their grace. As kube-controller-manager does
            # on leaving full disruption, the nodes still down get a fresh grace.
            for name in down:
                self._grace_restarted[name] = now
        self._paused = paused is not None
        PAUSED.set(1 if paused else 0)
        return NodeHealth(len(nodes), newest_first, paused)

    def mark_dgd_seen(self, key: str) -> None:
        self.dgd_seen_at[key] = time.monotonic()

    def observe_scale_latency(self, key: str, pods: int) -> None:
        seen = self.dgd_seen_at.get(key)
        if seen is not None:
            elapsed = time.monotonic() - seen
            for _ in range(pods):
                SCALE_TO_POD.observe(elapsed)


def _dgd_informer(kube: Kube, version: DgdVersion, namespace: str | None) -> Informer:
    """DGDs at ``version``, cached as views (v1alpha1's shape), compacted like every cached object."""

    def transform(obj: Obj) -> Obj:
        (obj.get("metadata") or {}).pop("managedFields", None)
        return compact(version.view(obj))

    return Informer(kube, version.kind, namespace=namespace, transform=transform)


def usable_by_dgd(ckpt: Obj, dgd_uid: str) -> bool:
    """A checkpoint owned by this DGD, or by no DGD at all (a user's, in the DGD's namespace)."""
    dgd_owners = [ref for ref in Meta(ckpt).owner_references if ref.get("kind") == "DynamoGraphDeployment"]
    return not dgd_owners or any(ref.get("uid") == dgd_uid for ref in dgd_owners)


def node_ready(node: Obj) -> bool:
    view = NodeView(node)
    return not view.unschedulable and view.condition_true("Ready")


def node_fits(node: Obj, compat: CheckpointCompatibility | None) -> bool:
    """A Ready, schedulable node with the GPUs the checkpoint needs (any, where it states none)."""
    return node_ready(node) and gpus_fit(node, compat)


def gpus_fit(node: Obj, compat: CheckpointCompatibility | None) -> bool:
    """Whether the node's GPUs, as its labels say, are those the checkpoint needs, whatever its health."""
    if compat is None:
        return True
    labels = Meta(node).labels
    if compat.gpu_product and labels.get(protocol.LABEL_GPU_PRODUCT) != compat.gpu_product:
        return False
    if compat.cuda_driver_major and labels.get(protocol.LABEL_CUDA_DRIVER_MAJOR) != compat.cuda_driver_major:
        return False
    if compat.gpu_count:
        try:
            return int(labels.get(protocol.LABEL_GPU_COUNT, "0")) >= compat.gpu_count
        except ValueError:
            return False
    return True
