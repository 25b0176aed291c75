"""What every reconciler shares: the client, the informer caches, the event recorder, the expectations
and the settings. Reads go to the caches (level-triggered, never to memory that a restart would lose)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cachetools import TTLCache
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility
from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.expectations import Expectations
from dynamo_snapshot.controller.failover import Failover
from dynamo_snapshot.controller.runtime import EventRecorder, Informer, Kube, Obj

PODS_CREATED = Counter(
    "dynsnap_worker_pods_created_total", "Worker pods created, by how they start", ["mode"]
)
SCALE_TO_POD = Histogram(
    "dynsnap_scale_request_to_pod_created_seconds",
    "From the DGD change that asked for more replicas being observed to the new pod existing",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)


@dataclass
class Context:
    kube: Kube
    dgds: Informer
    checkpoints: Informer
    pods: Informer
    jobs: Informer
    nodes: Informer
    recorder: EventRecorder
    # The process's own config, not a copy: what the reconcilers read is what the file and flags said.
    settings: ControllerConfig = field(default_factory=ControllerConfig)
    expectations: Expectations = field(default_factory=Expectations)
    failover: Failover = field(default_factory=Failover)
    # Bridges informer lag right after we create a DynamoCheckpoint, so a second reconcile does not
    # look for it by hash and create another one under a different name.
    recent_checkpoints: TTLCache[tuple[str, str], str] = field(
        default_factory=lambda: TTLCache(maxsize=10_000, ttl=30.0)
    )
    # Node-compatibility answers change only when nodes change; a short TTL spares a scan per replica.
    compatible_node_cache: TTLCache[tuple[str, str, int], int] = field(
        default_factory=lambda: TTLCache(maxsize=1_024, ttl=5.0)
    )
    dgd_seen_at: dict[str, float] = field(default_factory=dict)
    # DGD key -> the resourceVersion our last status write replaced. While the cache still holds that
    # version, another status write could only conflict (see DGDReconciler._write_status).
    status_written_over: dict[str, str] = field(default_factory=dict)
    # When each DGD's status was last written, to pace writes that carry no new generation.
    status_written_at: dict[str, float] = field(default_factory=dict)

    def pods_of(self, namespace: str, graph: str, service: str | None = None) -> list[Obj]:
        pods = [
            p
            for p in self.pods.by_label(protocol.LABEL_GRAPH, graph)
            if p["metadata"]["namespace"] == namespace
        ]
        if service is not None:
            pods = [p for p in pods if p["metadata"].get("labels", {}).get(protocol.LABEL_SERVICE) == service]
        return pods

    def checkpoint_by_hash(self, namespace: str, identity_hash: str) -> Obj | None:
        found = [
            c
            for c in self.checkpoints.by_label(protocol.LABEL_CHECKPOINT_HASH, identity_hash)
            if c["metadata"]["namespace"] == namespace
        ]
        if found:
            # Deterministic choice when a user pre-warmed one under another name: the oldest wins.
            return min(
                found, key=lambda c: (c["metadata"].get("creationTimestamp", ""), c["metadata"]["name"])
            )
        name = self.recent_checkpoints.get((namespace, identity_hash)) or identity_hash
        return self.checkpoints.get(f"{namespace}/{name}")

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
        return any(n["metadata"]["name"] not in exclude for n in self._fitting(compat))

    def _fitting(self, compat: CheckpointCompatibility | None) -> Iterator[Obj]:
        # The one node filter both questions share, so they cannot disagree about which nodes count.
        return (n for n in self.nodes.list() if node_fits(n, compat))

    def mark_dgd_seen(self, key: str) -> None:
        self.dgd_seen_at[key] = time.monotonic()

    def observe_scale_latency(self, key: str, pods: int) -> None:
        seen = self.dgd_seen_at.get(key)
        if seen is not None:
            elapsed = time.monotonic() - seen
            for _ in range(pods):
                SCALE_TO_POD.observe(elapsed)


def node_ready(node: Obj) -> bool:
    if node.get("spec", {}).get("unschedulable"):
        return False
    conds: Iterable[Obj] = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def node_fits(node: Obj, compat: CheckpointCompatibility | None) -> bool:
    """A Ready, schedulable node with the GPUs the checkpoint needs (any, where it states none)."""
    if not node_ready(node):
        return False
    if compat is None:
        return True
    labels = node["metadata"].get("labels", {})
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


def validation_message(err: ValidationError) -> str:
    """One line naming the first bad field, for Events and Conditions."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {first['msg']}{more}"
