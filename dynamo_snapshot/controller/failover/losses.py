"""Worker failures: telling a lost worker from a voluntary scale-down, and pacing the replacements.

A worker is lost when its pod failed, is crash-looping, was deleted by someone other than this
controller, or sits on a node that is gone, or NotReady or unreachable for longer than the node grace
(judged by `worker_loss`, which reads a node's health through `node_state`). Lost pods stop counting as
replicas at once, so the DGD reconcile that notices creates the replacement (a restore pod where the
service has a Ready checkpoint, kept off NotReady nodes) in the same pass.
Replacements draw from a per-service and a cluster-wide token bucket, so a node taking many workers down
does not send all of their restores to the storage at the same moment.

Two brakes keep failover from doing harm, as Kubernetes' node lifecycle controller has them:
- while a large share of the nodes is NotReady at once, the likelier fault is the control plane or the
  network, not the nodes: workers on NotReady nodes are kept, not replaced (`FailoverPaused`);
- a service whose workers die young (within `crash_backoff_reset_seconds` of their pod's `startTime`, or
  crash-looping under the kubelet) gets its replacements of them delayed like the kubelet's
  CrashLoopBackOff: the first at once, then 10 s, doubling to 5 min (`CrashLoopBackOff`), starting over once
  the service has gone `crash_backoff_reset_seconds` without an early death or a worker that lived that
  long dies.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from prometheus_client import Counter, Gauge, Histogram

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.kube import NORMAL, WARNING

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

PAUSED = Gauge(
    "dynsnap_failover_paused",
    "1 while workers on NotReady nodes are kept, not replaced: too many nodes are NotReady at once",
)
BACKOFF_SERVICES = Gauge(
    "dynsnap_failover_backoff_services", "Services in crash-loop backoff: their workers die young"
)
BACKOFF_WAITS = Counter(
    "dynsnap_failover_backoff_waits_total",
    "Times a service's replacements of workers that died young were made to wait",
)

# Losses that say something about the worker itself; node failures, evictions and deletions do not.
WORKER_CAUSES = frozenset({"pod-failed", "crash-loop", "process-exited"})

# Event reasons, and the reason that says the state ended (None: nothing is said when it ends).
WORKER_LOST = "WorkerLost"
FAILOVER_PAUSED, FAILOVER_RESUMED = "FailoverPaused", "FailoverResumed"
CRASH_LOOP_BACKOFF, CRASH_LOOP_BACKOFF_ENDED = "CrashLoopBackOff", "CrashLoopBackOffEnded"
NO_COMPATIBLE_NODE = "NoCompatibleNode"
# A state without an Event: new replicas wait for a compatible node that is NotReady inside its grace.
WAITING_FOR_NODE = "WaitingForNode"
NODE_GRACE = "NodeGrace"  # a note in status only: workers on NotReady nodes, not lost yet
_ENDS: dict[str, str | None] = {
    FAILOVER_PAUSED: FAILOVER_RESUMED,
    CRASH_LOOP_BACKOFF: CRASH_LOOP_BACKOFF_ENDED,
    NO_COMPATIBLE_NODE: None,
}
_SHOWN = (FAILOVER_PAUSED, NODE_GRACE)  # states degraded() reports (the others say it elsewhere)

Event = tuple[str, str, str]  # type, reason, message


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
    young: bool = False  # the worker died young: its replacement waits for the service's backoff


@dataclass
class CrashBackoff:
    """One service's crash-loop backoff (monotonic times)."""

    delay: float  # the wait the next early death after `until` starts
    last: float  # the latest early death
    what: str  # which worker died, how and when, for messages
    until: float = 0.0  # replacements of workers that died young wait until then
    until_wall: str = ""  # the same, as an RFC 3339 time for messages
    waits: int = 0  # waits started so far: the service is in backoff from the first


@dataclass
class Failover:
    """What the controller remembers about losses between their detection and their replacement being
    Ready, and about the states it reports once per change (crash-loop backoff, paused failover).

    When the cluster bucket cannot serve every service with losses, the service furthest below its
    desired count (then the one that lost a worker first) goes first: tokens the services ranked above
    still wait for are held back from the ones below.

    A service that cannot create pods yet (checkpointRef mode, its checkpoint not Ready) keeps its losses
    while it waits, so their replacements are paced once it can; until then they hold back no other
    service's tokens. Losses held by a crash-loop backoff hold back none either.

    Memory only: after a restart the losses are simply missing replicas again, which the level-triggered
    reconcile replaces (unpaced for that one pass, and without the latency samples), and every backoff
    starts over, as the kubelet's does when it restarts."""

    cluster_rate: float = 10.0
    cluster_burst: float = 10.0
    service_rate: float = 5.0
    service_burst: float = 5.0
    settings: ControllerConfig = field(default_factory=ControllerConfig)
    # Asks for the DGD (its key) to be reconciled again after this many seconds: set by the Controller to
    # its work queue, for the deadlines only this class knows (a backoff ending, a node grace running out).
    wake: Callable[[str, float], None] | None = None
    cluster: TokenBucket = field(init=False)
    services: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    # owner -> lost pod name -> the loss, until a replacement exists
    pending: dict[tuple[str, str], dict[str, Loss]] = field(default_factory=lambda: defaultdict(dict))
    # owner -> replacement pod name -> when the loss it replaces was observed, until that pod is Ready
    recovering: dict[tuple[str, str], dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # owner -> its desired replicas, as its last reconcile said (for the ordering)
    desired: dict[tuple[str, str], int] = field(default_factory=dict)
    # services whose last reconcile could not create pods -> what they wait for: their losses wait, and
    # are owed no tokens yet
    waiting: dict[tuple[str, str], str] = field(default_factory=dict)
    # owner -> its crash-loop backoff, from its first early death until it starts over
    backoffs: dict[tuple[str, str], CrashBackoff] = field(default_factory=dict)
    # owner -> state (an Event reason, or NODE_GRACE) -> what was said about it, while it lasts
    states: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cluster = TokenBucket(self.cluster_rate, self.cluster_burst)

    def observe(
        self,
        owner: tuple[str, str],
        pod_name: str,
        cause: str,
        node: str | None = None,
        lived: float | None = None,
    ) -> bool:
        """Note a loss; False when it was noted already (the same pod seen again). `lived`: how long the
        worker lived (None: unknown, as for a pod that never started)."""
        if pod_name in self.pending[owner]:
            return False
        now = time.monotonic()
        young = False
        if cause in WORKER_CAUSES:
            # The kubelet saw a crash-looping container die several times: young whatever the pod's age.
            young = (
                cause == "crash-loop" or lived is None or lived < self.settings.crash_backoff_reset_seconds
            )
            after = f" after {lived:.0f}s" if lived is not None else ""
            if young:
                self._died_young(owner, now, f"pod {pod_name} {cause}{after}")
            else:
                self.backoffs.pop(owner, None)  # a worker lived long enough: the backoff starts over
        self.pending[owner][pod_name] = Loss(now, node, young)
        FAILURES.labels(cause).inc()
        return True

    def _died_young(self, owner: tuple[str, str], now: float, what: str) -> None:
        cfg = self.settings
        backoff = self.backoffs.get(owner)
        if backoff is None or self._lapsed(backoff, now):
            # The first early death is replaced at once, as the kubelet restarts a container at once the
            # first time: one worker killed by accident should fail over in a second, not wait.
            self.backoffs[owner] = CrashBackoff(delay=cfg.crash_backoff_initial_seconds, last=now, what=what)
            return
        backoff.last, backoff.what = now, what
        if now < backoff.until:
            return  # dies while the service already waits: its replacement waits with the others
        backoff.until = now + backoff.delay
        backoff.until_wall = _rfc3339(datetime.now(UTC) + timedelta(seconds=backoff.delay))
        backoff.delay = min(cfg.crash_backoff_max_seconds, backoff.delay * 2)
        backoff.waits += 1
        BACKOFF_WAITS.inc()

    def _lapsed(self, backoff: CrashBackoff, now: float) -> bool:
        return now >= backoff.until and now - backoff.last >= self.settings.crash_backoff_reset_seconds

    def _held_by_backoff(self, owner: tuple[str, str], now: float) -> int:
        """Losses whose replacement waits for the service's crash-loop backoff now."""
        backoff = self.backoffs.get(owner)
        if backoff is None or now >= backoff.until:
            return 0
        return sum(1 for loss in self.pending.get(owner, {}).values() if loss.young)

    def avoid_nodes(self, owner: tuple[str, str]) -> list[str]:
        """Nodes the service's pending losses happened on: its replacements prefer other nodes."""
        return sorted({loss.node for loss in self.pending.get(owner, {}).values() if loss.node})

    def allowance(
        self, owner: tuple[str, str], missing: int, desired: int | None = None
    ) -> tuple[int, float]:
        """How many of `missing` new pods may be created now, and when to look again if the token buckets
        did not allow all.

        Only replacements are paced: pods beyond the service's pending losses (a scale-up) are not.
        Replacements of workers that died young wait for the service's crash-loop backoff; that wait
        is not returned, the service is woken (see `wake`) when it ends.
        """
        losses = len(self.pending.get(owner, {}))
        if losses == 0:
            return missing, 0.0
        if desired:
            self.desired[owner] = desired
        bucket = self.services.get(owner)
        if bucket is None:
            bucket = self.services[owner] = TokenBucket(self.service_rate, self.service_burst)
        now = time.monotonic()  # not before the bucket's stamp: it would count negative time
        paced = min(missing, losses)
        held = min(paced, self._held_by_backoff(owner, now))
        if held:
            self._wake(owner, self.backoffs[owner].until - now)
        payable = paced - held
        held_back = self._wanted_before(owner, now)
        got = bucket.take(payable, now)
        granted = self.cluster.take(got, now, keep=held_back)
        bucket.tokens += got - granted  # give back what the cluster bucket refused
        later = (
            0.0 if granted == payable else max(bucket.wait_for(1), self.cluster.wait_for(held_back + 1), 0.05)
        )
        return granted + (missing - paced), later

    def _rank(self, owner: tuple[str, str]) -> tuple[float, float]:
        lost = self.pending.get(owner, {})
        first = min((loss.seen for loss in lost.values()), default=0.0)
        # The fraction of the desired replicas lost and not replaced; unknown until its reconcile asks.
        deficit = len(lost) / self.desired[owner] if owner in self.desired else 0.0
        return (-deficit, first)

    def _wanted_before(self, owner: tuple[str, str], now: float) -> int:
        """Replacements still owed, and wanted now, to services that go before `owner`."""
        mine = self._rank(owner)
        return sum(
            len(lost) - self._held_by_backoff(o, now)
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
        self.waiting.pop(owner, None)
        self.backoffs.pop(owner, None)
        if CRASH_LOOP_BACKOFF in self.states.pop(owner, {}):
            BACKOFF_SERVICES.dec()

    def owners(self, dgd_key: str) -> set[tuple[str, str]]:
        """The services of a DGD this remembers anything about."""
        tables = (self.pending, self.services, self.recovering, self.desired, self.waiting, self.backoffs)
        found = {o for table in tables for o in table if o[0] == dgd_key}
        return found | {o for o, said in self.states.items() if said and o[0] == dgd_key}

    def in_state(self, state: str) -> set[str]:
        """The DGDs (keys) with a service in `state`."""
        return {o[0] for o, said in self.states.items() if state in said}

    def settle(
        self,
        owner: tuple[str, str],
        owed: int,
        *,
        waiting: bool = False,
        waits_for: str = "the service's checkpoint",
    ) -> None:
        """Keep no more losses pending than the `owed` replicas the service is short of; say whether it
        can create them now or `waiting` (for `waits_for`) it cannot yet.

        Only `replaced` retires a loss otherwise, and it runs only when pods are created: losses a
        scale-down absorbed would keep the service Degraded and hold back other services' tokens for ever.
        The newest losses go: the oldest marks when the service first fell short, which its rank and its
        latency samples are measured from. A waiting service's losses stay (dropping them would let its
        replacements through unpaced, as a scale-up, once it can create pods), but hold back no tokens;
        once it can create pods they count as seen then.
        """
        if waiting:
            self.waiting[owner] = waits_for
        elif owner in self.waiting:
            del self.waiting[owner]
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
        """These replacement pods now exist: the oldest losses are done (those not held by a backoff
        first: theirs were the replacements allowed), and the new pods are watched until Ready."""
        lost = self.pending.get(owner)
        if not lost:
            return
        now = time.monotonic()
        holding = self._held_by_backoff(owner, now) > 0
        oldest = sorted(lost.items(), key=lambda kv: (holding and kv[1].young, kv[1].seen))
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
        """Why the service is below what it should be because of losses or node trouble, or None."""
        said = self.states.get(owner, {})
        parts = [said[state] for state in _SHOWN if state in said]
        lost, starting = len(self.pending.get(owner, {})), len(self.recovering.get(owner, {}))
        if lost or starting:
            why = (
                f"service {owner[1]}: recovering from lost workers "
                f"({lost} not yet replaced, {starting} replacement(s) not Ready yet)"
            )
            held = self._held_by_backoff(owner, time.monotonic())
            if held:
                backoff = self.backoffs[owner]
                why += (
                    f"; {CRASH_LOOP_BACKOFF}: its workers die young (latest: {backoff.what}), "
                    f"{held} replacement(s) wait until {backoff.until_wall}"
                )
            held = self.held_back(owner)
            parts.append(f"{why}; replacements wait for {self.waiting[owner]}" if held else why)
        return "; ".join(parts) or None

    def cause(self, owner: tuple[str, str]) -> str | None:
        """The condition reason for what `degraded` reports, most telling first; None for plain recovery."""
        said = self.states.get(owner, {})
        for state in _SHOWN:
            if state in said:
                return state
        return CRASH_LOOP_BACKOFF if self._held_by_backoff(owner, time.monotonic()) else None

    def replacing(self, owner: tuple[str, str]) -> str:
        """How a WorkerLost event ends: what happens next about the loss."""
        if owner in self.waiting:
            return f"its replacement waits for {self.waiting[owner]}"
        backoff = self.backoffs.get(owner)
        if self._held_by_backoff(owner, time.monotonic()) and backoff is not None:
            return f"its replacement waits for the crash-loop backoff, until {backoff.until_wall}"
        return "replacing it"

    def held_back(self, owner: tuple[str, str]) -> bool:
        """Whether the service owes replacements that it cannot create yet (it waits for its checkpoint)."""
        return owner in self.waiting and bool(self.pending.get(owner))

    # ------------------------------------------------------------------ states reported once per change
    def report(self, owner: tuple[str, str], state: str, message: str | None) -> Event | None:
        """Say whether `state` holds for the service (`message`: what to say about it) or not (None);
        the Event to record when that began or ended, None while it stays as it was."""
        said = self.states.setdefault(owner, {})
        before = said.get(state)
        if message is not None:
            said[state] = message
        else:
            said.pop(state, None)
        if not said:
            self.states.pop(owner, None)
        if (before is None) == (message is None) or state not in _ENDS:
            return None
        if state == CRASH_LOOP_BACKOFF:
            BACKOFF_SERVICES.inc(1 if message is not None else -1)
        if message is not None:
            return WARNING, state, message
        ended = _ENDS[state]
        return (NORMAL, ended, f"service {owner[1]}: {_ENDED[state]}") if ended else None

    def review(
        self,
        owner: tuple[str, str],
        *,
        grace: dict[str, datetime] | None = None,
        paused: str | None = None,
        kept: dict[str, str] | None = None,
    ) -> list[Event]:
        """After a look at the service's pods: the Events for its states that began or ended.

        `grace`: NotReady nodes with workers of the service -> when their node grace ends; `paused`: why
        failover for node causes is paused, with `kept` the workers (-> node) it keeps for that reason.
        """
        events: list[Event] = []
        note = None
        if grace:
            first = min(grace.values())
            note = (
                f"service {owner[1]}: its workers on NotReady node(s) {', '.join(sorted(grace))} count "
                f"as lost from {_rfc3339(first)} if their node is not Ready again by then"
            )
            self._wake(owner, (first - datetime.now(UTC)).total_seconds() + 0.1)
        self.report(owner, NODE_GRACE, note)
        why = None
        if paused and kept:
            where = ", ".join(f"{pod} on {node}" for pod, node in sorted(kept.items()))
            why = f"{FAILOVER_PAUSED}: {paused}; service {owner[1]} keeps its workers there ({where})"
        event = self.report(owner, FAILOVER_PAUSED, why)
        if event:
            events.append(event)
        now = time.monotonic()
        backoff = self.backoffs.get(owner)
        if backoff is not None and self._lapsed(backoff, now):
            del self.backoffs[owner]
            backoff = None
        message = None
        if backoff is not None and backoff.waits:
            cfg = self.settings
            message = (
                f"service {owner[1]}: its workers die young (latest: {backoff.what}); replacements of "
                f"workers that lived less than {cfg.crash_backoff_reset_seconds:g}s wait, from "
                f"{cfg.crash_backoff_initial_seconds:g}s doubling to {cfg.crash_backoff_max_seconds:g}s"
            )
            # Looks again when the backoff may end: no early death for the reset time.
            ends = max(backoff.until, backoff.last + cfg.crash_backoff_reset_seconds)
            self._wake(owner, ends - now + 0.1)
        event = self.report(owner, CRASH_LOOP_BACKOFF, message)
        if event:
            events.append(event)
        return events

    def _wake(self, owner: tuple[str, str], delay: float) -> None:
        if self.wake is not None:
            self.wake(owner[0], max(0.0, delay))


_ENDED = {
    FAILOVER_PAUSED: "failover resumed: workers on NotReady nodes are no longer kept",
    CRASH_LOOP_BACKOFF: "crash-loop backoff ended: no worker died young for the reset time",
}


def _rfc3339(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
