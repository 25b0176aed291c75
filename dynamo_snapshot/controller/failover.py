"""Worker failures: telling a lost worker from a voluntary scale-down, and pacing the replacements.

A worker is lost when its pod failed, is crash-looping, was deleted by someone other than this
controller, or sits on a node that is NotReady, unreachable or gone. Lost pods stop counting as replicas
at once, so the DGD reconcile that notices creates the replacement (a restore pod where the service has
a Ready checkpoint; the scheduler keeps it off the tainted node) in the same pass. Replacements draw from
a per-service and a cluster-wide token bucket, so a node taking many workers down does not send all of
their restores to the storage at the same moment.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.podspec import MAIN_CONTAINER
from dynamo_snapshot.controller.runtime import Obj

FAILURES = Counter("dynsnap_worker_failures_total", "Worker losses detected, by cause", ["cause"])
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
OBSERVED_TO_CREATED = Histogram(
    "dynsnap_failover_observed_to_created_seconds",
    "From a worker loss being observed to its replacement pod existing",
    buckets=_LATENCY_BUCKETS,
)
OBSERVED_TO_READY = Histogram(
    "dynsnap_failover_observed_to_ready_seconds",
    "From a worker loss being observed to its replacement pod being Ready",
    buckets=_LATENCY_BUCKETS,
)

CRASH_LOOP_RESTARTS = 3
_UNHEALTHY_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def node_healthy(node: Obj | None) -> bool:
    """A node a worker can live on: it exists, says Ready, and is not tainted unreachable/not-ready."""
    if node is None:
        return False
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or []
    )
    taints = (node.get("spec") or {}).get("taints") or []
    return ready and not any(t.get("key") in _UNHEALTHY_TAINTS for t in taints)


def crash_looping(pod: Obj) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if (
            waiting.get("reason") == "CrashLoopBackOff"
            or int(status.get("restartCount") or 0) >= CRASH_LOOP_RESTARTS
        ):
            return True
    return False


def loss_cause(pod: Obj, node: Obj | None) -> str | None:
    """Why a (not deleted by us) pod no longer counts as a worker; None while it does."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    if annotations.get(protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, MAIN_CONTAINER)):
        return "process-exited"  # reported by the node agent where no kubelet watches the worker
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Failed":
        reason = (pod.get("status") or {}).get("reason") or ""
        return "evicted" if reason in ("Evicted", "Preempting", "Terminated") else "pod-failed"
    if crash_looping(pod):
        return "crash-loop"
    if (pod.get("spec") or {}).get("nodeName"):
        if node is None:
            return "node-deleted"
        if not node_healthy(node):
            return "node-not-ready"
    return None


@dataclass
class TokenBucket:
    rate: float  # tokens per second
    burst: float
    tokens: float = -1.0
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, want: int, now: float | None = None, keep: float = 0.0) -> int:
        """Up to `want` tokens, as many as there are beyond `keep` (held back for others)."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        got = max(0, min(want, int(self.tokens - keep)))
        self.tokens -= got
        return got

    def wait_for(self, tokens: float) -> float:
        """Seconds until `tokens` tokens are there (as far as the burst allows)."""
        need = min(tokens, self.burst)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate


@dataclass
class Loss:
    seen: float  # monotonic time the loss was observed
    node: str | None


@dataclass
class Failover:
    """What the controller remembers about losses between their detection and their replacement being
    Ready.

    When the cluster bucket cannot serve every service with losses, the service furthest below its
    desired count (then the one that lost a worker first) goes first: tokens the services ranked above
    still wait for are held back from the ones below.

    A service that cannot create pods yet (checkpointRef mode, its checkpoint not Ready) keeps its losses
    while it waits, so their replacements are paced once it can; until then they hold back no other
    service's tokens.

    Memory only: after a restart the losses are simply missing replicas again, which the level-triggered
    reconcile replaces (unpaced for that one pass, and without the latency samples)."""

    cluster_rate: float = 10.0
    cluster_burst: float = 10.0
    service_rate: float = 5.0
    service_burst: float = 5.0
    cluster: TokenBucket = field(init=False)
    services: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    # owner -> lost pod name -> the loss, until a replacement exists
    pending: dict[tuple[str, str], dict[str, Loss]] = field(default_factory=lambda: defaultdict(dict))
    # owner -> replacement pod name -> when the loss it replaces was observed, until that pod is Ready
    recovering: dict[tuple[str, str], dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # owner -> its desired replicas, as its last reconcile said (for the ordering)
    desired: dict[tuple[str, str], int] = field(default_factory=dict)
    # services whose last reconcile could not create pods: their losses wait, and are owed no tokens yet
    waiting: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.cluster = TokenBucket(self.cluster_rate, self.cluster_burst)

    def observe(self, owner: tuple[str, str], pod_name: str, cause: str, node: str | None = None) -> bool:
        """Note a loss; False when it was noted already (the same pod seen again)."""
        if pod_name in self.pending[owner]:
            return False
        self.pending[owner][pod_name] = Loss(time.monotonic(), node)
        FAILURES.labels(cause).inc()
        return True

    def avoid_nodes(self, owner: tuple[str, str]) -> list[str]:
        """Nodes the service's pending losses happened on: its replacements prefer other nodes."""
        return sorted({loss.node for loss in self.pending.get(owner, {}).values() if loss.node})

    def allowance(
        self, owner: tuple[str, str], missing: int, desired: int | None = None
    ) -> tuple[int, float]:
        """How many of `missing` new pods may be created now, and when to look again if not all.

        Only replacements are paced: pods beyond the service's pending losses (a scale-up) are not.
        """
        losses = len(self.pending.get(owner, {}))
        if losses == 0:
            return missing, 0.0
        paced = min(missing, losses)
        if desired:
            self.desired[owner] = desired
        bucket = self.services.get(owner)
        if bucket is None:
            bucket = self.services[owner] = TokenBucket(self.service_rate, self.service_burst)
        now = time.monotonic()
        held_back = self._wanted_before(owner)
        got = bucket.take(paced, now)
        granted = self.cluster.take(got, now, keep=held_back)
        bucket.tokens += got - granted  # give back what the cluster bucket refused
        later = (
            0.0 if granted == paced else max(bucket.wait_for(1), self.cluster.wait_for(held_back + 1), 0.05)
        )
        return granted + (missing - paced), later

    def _rank(self, owner: tuple[str, str]) -> tuple[float, float]:
        lost = self.pending.get(owner, {})
        first = min((loss.seen for loss in lost.values()), default=0.0)
        # The fraction of the desired replicas lost and not replaced; unknown until its reconcile asks.
        deficit = len(lost) / self.desired[owner] if owner in self.desired else 0.0
        return (-deficit, first)

    def _wanted_before(self, owner: tuple[str, str]) -> int:
        """Replacements still owed to services that go before `owner`."""
        mine = self._rank(owner)
        return sum(
            len(lost)
            for o, lost in self.pending.items()
            if o != owner and lost and o not in self.waiting and self._rank(o) < mine
        )

    def forget(self, dgd_key: str) -> None:
        """The DGD is gone: its losses will never be replaced."""
        for owner in self.owners(dgd_key):
            self.forget_service(owner)

    def forget_service(self, owner: tuple[str, str]) -> None:
        """The service was removed or stopped checkpointing: it owes and follows nothing any more."""
        self.pending.pop(owner, None)
        self.services.pop(owner, None)
        self.recovering.pop(owner, None)
        self.desired.pop(owner, None)
        self.waiting.discard(owner)

    def owners(self, dgd_key: str) -> set[tuple[str, str]]:
        """The services of a DGD this remembers anything about."""
        tables = (self.pending, self.services, self.recovering, self.desired, self.waiting)
        return {o for table in tables for o in table if o[0] == dgd_key}

    def settle(self, owner: tuple[str, str], owed: int, *, waiting: bool = False) -> None:
        """Keep no more losses pending than the `owed` replicas the service is short of; say whether it
        can create them now or `waiting` (for its checkpoint) it cannot yet.

        Only `replaced` retires a loss otherwise, and it runs only when pods are created: losses a
        scale-down absorbed would keep the service Degraded and hold back other services' tokens for ever.
        The newest losses go: the oldest marks when the service first fell short, which its rank and its
        latency samples are measured from. A waiting service's losses stay (dropping them would let its
        replacements through unpaced, as a scale-up, once it can create pods), but hold back no tokens;
        once it can create pods they count as seen then.
        """
        if waiting:
            self.waiting.add(owner)
        elif owner in self.waiting:
            self.waiting.discard(owner)
            # Failover latency is measured from when the controller could act: the time the service
            # waited for its checkpoint is not the failover's.
            now = time.monotonic()
            for name, loss in self.pending.get(owner, {}).items():
                self.pending[owner][name] = dataclasses.replace(loss, seen=now)
        lost = self.pending.get(owner)
        if not lost or len(lost) <= max(0, owed):
            return
        oldest = sorted(lost.items(), key=lambda kv: kv[1].seen)
        for name, _ in oldest[max(0, owed) :]:
            del lost[name]
        if not lost:
            self.pending.pop(owner, None)

    def replaced(self, owner: tuple[str, str], new_pods: list[str]) -> None:
        """These replacement pods now exist: the oldest losses are done, and the new pods are watched
        until Ready."""
        lost = self.pending.get(owner)
        if not lost:
            return
        now = time.monotonic()
        oldest = sorted(lost.items(), key=lambda kv: kv[1].seen)
        for (name, loss), new_pod in zip(oldest, new_pods, strict=False):
            OBSERVED_TO_CREATED.observe(now - loss.seen)
            self.recovering[owner][new_pod] = loss.seen
            del lost[name]
        if not lost:
            self.pending.pop(owner, None)

    def track_ready(self, owner: tuple[str, str], ready: set[str], existing: set[str]) -> None:
        """Record replacements that became Ready; forget those that no longer exist."""
        watching = self.recovering.get(owner)
        if not watching:
            return
        now = time.monotonic()
        for name in list(watching):
            if name in ready:
                OBSERVED_TO_READY.observe(now - watching.pop(name))
            elif name not in existing:
                del watching[name]
        if not watching:
            self.recovering.pop(owner, None)

    def degraded(self, owner: tuple[str, str]) -> str | None:
        """Why the service is below what it should be because of losses, or None."""
        lost, starting = len(self.pending.get(owner, {})), len(self.recovering.get(owner, {}))
        if not lost and not starting:
            return None
        why = (
            f"service {owner[1]}: recovering from lost workers "
            f"({lost} not yet replaced, {starting} replacement(s) not Ready yet)"
        )
        return f"{why}; replacements wait for its checkpoint" if self.held_back(owner) else why

    def replacing(self, owner: tuple[str, str]) -> str:
        """How a WorkerLost event ends: what happens next about the loss."""
        if owner in self.waiting:
            return "its replacement waits for the service's checkpoint"
        return "replacing it"

    def held_back(self, owner: tuple[str, str]) -> bool:
        """Whether the service owes replacements that it cannot create yet (it waits for its checkpoint)."""
        return owner in self.waiting and bool(self.pending.get(owner))
