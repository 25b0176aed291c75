"""Worker failures: telling a lost worker from a voluntary scale-down, and pacing the replacements.

A worker is lost when its pod failed, is crash-looping, was deleted by someone other than this
controller, or sits on a node that is NotReady, unreachable or gone. Lost pods stop counting as replicas
at once, so the DGD reconcile that notices creates the replacement (a restore pod where the service has
a Ready checkpoint; the scheduler keeps it off the tainted node) in the same pass. Replacements draw from
a per-service and a cluster-wide token bucket, so a node taking many workers down does not send all of
their restores to the storage at the same moment.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from dynamo_snapshot.controller.runtime import Obj

FAILURES = Counter("dynsnap_worker_failures_total", "Worker losses detected, by cause", ["cause"])
OBSERVED_TO_CREATED = Histogram(
    "dynsnap_failover_observed_to_created_seconds",
    "From a worker loss being observed to its replacement pod existing",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
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

    def take(self, want: int, now: float | None = None) -> int:
        """Up to `want` tokens, as many as there are."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        got = min(want, int(self.tokens))
        self.tokens -= got
        return got

    def wait_for_one(self) -> float:
        """Seconds until one token is there."""
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


@dataclass
class Failover:
    """What the controller remembers about losses between their detection and their replacement.

    Memory only: after a restart the losses are simply missing replicas again, which the level-triggered
    reconcile replaces (unpaced for that one pass, and without the latency sample)."""

    cluster_rate: float = 10.0
    cluster_burst: float = 10.0
    service_rate: float = 5.0
    service_burst: float = 5.0
    cluster: TokenBucket = field(init=False)
    services: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    # owner -> pod names lost and when the loss was observed (monotonic)
    pending: dict[tuple[str, str], dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def __post_init__(self) -> None:
        self.cluster = TokenBucket(self.cluster_rate, self.cluster_burst)

    def observe(self, owner: tuple[str, str], pod_name: str, cause: str) -> bool:
        """Note a loss; False when it was noted already (the same pod seen again)."""
        if pod_name in self.pending[owner]:
            return False
        self.pending[owner][pod_name] = time.monotonic()
        FAILURES.labels(cause).inc()
        return True

    def allowance(self, owner: tuple[str, str], missing: int) -> tuple[int, float]:
        """How many of `missing` new pods may be created now, and when to look again if not all.

        Only replacements are paced: pods beyond the service's pending losses (a scale-up) are not.
        """
        losses = len(self.pending.get(owner, {}))
        if losses == 0:
            return missing, 0.0
        paced = min(missing, losses)
        bucket = self.services.get(owner)
        if bucket is None:
            bucket = self.services[owner] = TokenBucket(self.service_rate, self.service_burst)
        now = time.monotonic()
        got = bucket.take(paced, now)
        granted = self.cluster.take(got, now)
        bucket.tokens += got - granted  # give back what the cluster bucket refused
        later = 0.0 if granted == paced else max(bucket.wait_for_one(), self.cluster.wait_for_one(), 0.05)
        return granted + (missing - paced), later

    def forget(self, dgd_key: str) -> None:
        """The DGD is gone: its losses will never be replaced."""
        for owner in [o for o in self.pending if o[0] == dgd_key]:
            del self.pending[owner]
        for owner in [o for o in self.services if o[0] == dgd_key]:
            del self.services[owner]

    def replaced(self, owner: tuple[str, str], count: int) -> None:
        """`count` replacement pods now exist: the oldest losses are done."""
        lost = self.pending.get(owner)
        if not lost:
            return
        now = time.monotonic()
        for name, seen in sorted(lost.items(), key=lambda kv: kv[1])[:count]:
            OBSERVED_TO_CREATED.observe(now - seen)
            del lost[name]
        if not lost:
            self.pending.pop(owner, None)
