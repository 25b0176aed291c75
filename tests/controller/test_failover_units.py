"""Failover bookkeeping and pacing: pure logic."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.failover import losses
from dynamo_snapshot.controller.failover.losses import Failover, TokenBucket
from dynamo_snapshot.controller.failover.node_state import node_healthy, unhealthy_since
from dynamo_snapshot.controller.failover.worker_loss import loss_cause, worker_lifetime
from dynamo_snapshot.controller.podspec import keep_off_nodes
from dynamo_snapshot.kube.pods import unschedulable


def test_token_bucket_paces_after_its_burst() -> None:
    bucket = TokenBucket(rate=5.0, burst=5.0, stamp=100.0)
    assert bucket.take(8, now=100.0) == 5
    assert bucket.take(8, now=100.0) == 0
    assert bucket.take(8, now=100.4) == 2


def test_only_replacements_are_paced_and_forgotten_with_their_dgd() -> None:
    fo = Failover(cluster_rate=1.0, cluster_burst=2.0, service_rate=1.0, service_burst=2.0)
    owner = ("ns/a", "svc")
    for i in range(4):
        assert fo.observe(owner, f"p{i}", "node-deleted")
    assert not fo.observe(owner, "p0", "node-deleted")  # the same loss seen again
    allowed, later = fo.allowance(owner, 6)  # 4 replacements + 2 scale-up pods
    assert allowed == 2 + 2
    assert later > 0
    fo.replaced(owner, ["r0", "r1"])
    assert len(fo.pending[owner]) == 2
    fo.forget("ns/a")
    assert owner not in fo.pending
    assert fo.allowance(owner, 3) == (3, 0.0)


def test_loss_causes() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    tainted = {**ready, "spec": {"taints": [{"key": "node.kubernetes.io/unreachable"}]}}
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    assert node_healthy(ready)
    assert not node_healthy(tainted)
    assert not node_healthy(None)
    assert loss_cause(pod, ready) is None
    assert loss_cause(pod, tainted) == "node-not-ready"
    assert loss_cause(pod, None) == "node-deleted"
    assert loss_cause({**pod, "status": {"phase": "Failed", "reason": "Evicted"}}, ready) == "evicted"
    looping = {**pod, "status": {"phase": "Running", "containerStatuses": [{"restartCount": 5}]}}
    assert loss_cause(looping, ready) == "crash-loop"

    exited = {
        **pod,
        "metadata": {
            "name": "p",
            "annotations": {
                protocol.per_container(protocol.ANNOTATION_WORKLOAD_EXITED, "main"): "worker process 7 exited"
            },
        },
    }
    assert loss_cause(exited, ready) == "process-exited"


def test_the_service_furthest_below_desired_is_replaced_first() -> None:
    fo = Failover(cluster_rate=0.001, cluster_burst=4.0, service_rate=100.0, service_burst=100.0)
    small, big = ("ns/a", "svc"), ("ns/b", "svc")
    for i in range(2):
        fo.observe(small, f"a{i}", "node-deleted", "n1")  # 2 of 10 lost
    for i in range(3):
        fo.observe(big, f"b{i}", "node-deleted", "n1")  # 3 of 4 lost
    fo.allowance(big, 3, desired=4)  # b's reconcile states its desired count (and takes 3 of 4 tokens)
    fo.replaced(big, ["rb0", "rb1"])  # ... of which only 2 pods got created
    # a asks next: one token is left, but b (now 1 of 4 lost: 25%) still goes before a (2 of 10: 20%).
    allowed, later = fo.allowance(small, 2, desired=10)
    assert allowed == 0
    assert later > 0
    fo.replaced(big, ["rb2"])
    allowed, _ = fo.allowance(small, 2, desired=10)
    assert allowed == 1  # b is whole again: a gets the last token


def test_replacements_are_followed_until_ready_and_the_service_is_degraded_meanwhile() -> None:
    fo = Failover()
    owner = ("ns/a", "svc")
    assert fo.degraded(owner) is None
    fo.observe(owner, "p0", "process-exited", "n1")
    fo.observe(owner, "p1", "process-exited", "n2")
    assert fo.avoid_nodes(owner) == ["n1", "n2"]
    assert "2 not yet replaced" in (fo.degraded(owner) or "")
    fo.replaced(owner, ["r0", "r1"])
    assert fo.avoid_nodes(owner) == []
    assert "2 replacement(s) not Ready" in (fo.degraded(owner) or "")
    fo.track_ready(owner, ready={"r0"}, existing={"r0"})  # r1 was deleted meanwhile: stop following it
    assert fo.degraded(owner) is None


def test_keep_off_nodes_required_and_preferred() -> None:
    spec: dict[str, object] = {}
    keep_off_nodes(spec, ["n2", "n1"], required=True)
    keep_off_nodes(spec, ["n3"], required=False)
    affinity = spec["affinity"]["nodeAffinity"]  # type: ignore[index]
    [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]}
    ]
    [pref] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"][0]["values"] == ["n3"]


def test_unschedulable_says_for_how_long_and_why() -> None:
    now = datetime(2026, 11, 29, 12, 0, 30, tzinfo=UTC)
    cond = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        "lastTransitionTime": "2026-11-29T12:00:00Z",
    }
    pending = {"status": {"phase": "Pending", "conditions": [cond]}}
    assert unschedulable(pending, now) == (30.0, cond["message"])
    assert unschedulable({"status": {"phase": "Running", "conditions": [cond]}}, now) is None
    assert unschedulable({"status": {"phase": "Pending"}}, now) is None  # not looked at by the scheduler yet
    gated = {"status": {"phase": "Pending", "conditions": [{**cond, "reason": "SchedulingGated"}]}}
    assert unschedulable(gated, now) is None


def test_the_order_follows_the_losses_still_pending() -> None:
    fo = Failover(cluster_rate=0.001, cluster_burst=4.0, service_rate=100.0, service_burst=100.0)
    small, big = ("ns/a", "svc"), ("ns/b", "svc")
    for i in range(3):
        fo.observe(small, f"a{i}", "node-deleted", "n1")  # 3 of 10 lost: 30%
        fo.observe(big, f"b{i}", "node-deleted", "n1")  # 3 of 4 lost: 75%
    fo.allowance(big, 3, desired=4)  # takes 3 of the 4 tokens
    fo.replaced(big, ["rb0", "rb1"])  # b is down to 1 of 4 lost: 25%, now behind a
    allowed, _ = fo.allowance(small, 3, desired=10)
    assert allowed == 1  # the last token goes to a, nothing is held back for b


def test_losses_a_scale_down_absorbed_hold_back_no_other_service() -> None:
    fo = Failover(cluster_rate=0.001, cluster_burst=4.0, service_rate=100.0, service_burst=100.0)
    a, b = ("ns/a", "svc"), ("ns/b", "svc")
    for i in range(10):
        fo.observe(a, f"a{i}", "node-deleted", "n1")  # all 10 of a's workers lost
    assert fo.allowance(a, 2, desired=10) == (2, 0.0)  # a asks for 2 (takes 2 of the 4 tokens)
    fo.replaced(a, ["ra0", "ra1"])  # 8 of 10 still lost: 80%
    fo.observe(b, "b0", "node-deleted", "n1")  # 1 of 4 lost: 25%, behind a
    allowed, later = fo.allowance(b, 1, desired=4)
    assert allowed == 0  # the 2 tokens left are held for a
    assert later > 0
    fo.settle(a, 0)  # a was scaled down to the 2 pods it has: it is owed nothing any more
    assert _pending(fo, a) == []
    assert fo.allowance(b, 1, desired=4) == (1, 0.0)


def test_a_scale_down_drops_the_newest_losses_and_clears_degraded() -> None:
    fo = Failover()
    owner, other = ("ns/a", "svc"), ("ns/a", "other")
    for i in range(3):
        fo.observe(owner, f"p{i}", "pod-failed", f"n{i}", lived=3600)
    fo.observe(other, "q0", "pod-failed", "n9", lived=3600)
    fo.settle(owner, 5)  # more replicas missing than lost: every loss is still owed
    assert _pending(fo, owner) == ["p0", "p1", "p2"]
    fo.settle(owner, 1)  # scaled down by two
    # The oldest stays: the service has been short since then.
    assert _pending(fo, owner) == ["p0"]
    assert fo.avoid_nodes(owner) == ["n0"]
    assert "1 not yet replaced" in (fo.degraded(owner) or "")
    fo.settle(owner, 0)
    assert fo.degraded(owner) is None
    assert fo.owners("ns/a") == {other}  # the other service's loss is untouched


def test_losses_of_a_waiting_service_are_kept_hold_back_nothing_and_are_paced_later() -> None:
    fo = Failover(cluster_rate=0.001, cluster_burst=4.0, service_rate=0.001, service_burst=2.0)
    a, b = ("ns/a", "svc"), ("ns/b", "svc")
    fo.observe(a, "a0", "pod-failed", "n1", lived=3600)
    assert fo.allowance(a, 1, desired=4) == (1, 0.0)  # replaced while a's checkpoint was Ready
    fo.replaced(a, ["ra0"])
    for i in range(1, 4):
        fo.observe(a, f"a{i}", "pod-failed", "n1", lived=3600)  # 3 of 4 lost while a waits for its checkpoint
    fo.settle(a, 3, waiting=True)
    assert _pending(fo, a) == ["a1", "a2", "a3"]
    assert fo.held_back(a)
    assert "wait for the service's checkpoint" in (fo.degraded(a) or "")
    assert fo.replacing(a) == "its replacement waits for the service's checkpoint"
    assert fo.replacing(b) == "replacing it"
    # a ranks first (75% lost), but cannot use tokens now: none are held back from b for it.
    fo.observe(b, "b0", "pod-failed", "n1", lived=3600)
    assert fo.allowance(b, 1, desired=10) == (1, 0.0)
    fo.replaced(b, ["rb0"])
    # The checkpoint is Ready: a's replacements are paced like any other (1 token left in its bucket),
    # and their latency counts from now, not from the losses during the wait.
    ready_at = time.monotonic()
    fo.settle(a, 3)
    assert all(loss.seen >= ready_at for loss in fo.pending[a].values())
    assert not fo.held_back(a)
    assert fo.replacing(a) == "replacing it"
    allowed, later = fo.allowance(a, 3, desired=4)
    assert allowed == 1
    assert later > 0
    fo.replaced(a, ["ra1"])
    assert fo.avoid_nodes(a) == ["n1"]
    assert "2 not yet replaced" in (fo.degraded(a) or "")
    fo.forget_service(a)
    assert fo.owners("ns/a") == set()


def test_a_released_service_is_forgotten_alone() -> None:
    fo = Failover()
    owner, other = ("ns/a", "svc"), ("ns/a", "other")
    fo.observe(owner, "p0", "pod-failed")
    fo.observe(other, "q0", "pod-failed")
    fo.allowance(owner, 1, desired=2)
    fo.replaced(owner, ["r0"])
    fo.observe(owner, "p1", "pod-failed")
    fo.forget_service(owner)
    assert fo.degraded(owner) is None
    assert fo.owners("ns/a") == {other}
    assert fo.allowance(owner, 3) == (3, 0.0)
    assert "1 not yet replaced" in (fo.degraded(other) or "")


def _pending(fo: Failover, owner: tuple[str, str]) -> list[str]:
    return sorted(fo.pending.get(owner, {}))


class _Clock:
    """time.monotonic for the failover module, moved by hand; ahead of the real one, so token buckets made
    during the test never see time run backwards. It starts on a whole second so that whole-second steps add
    up exactly, however long the machine has been up."""

    def __init__(self) -> None:
        self.now = float(math.ceil(time.monotonic()) + 1)

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(losses.time, "monotonic", fake)
    return fake


def _backoff_failover(**settings: float) -> tuple[Failover, list[tuple[str, float]]]:
    config = ControllerConfig(
        crash_backoff_initial_seconds=10, crash_backoff_max_seconds=40, crash_backoff_reset_seconds=100
    ).model_copy(update=settings)
    woken: list[tuple[str, float]] = []
    fo = Failover(settings=config, wake=lambda key, delay: woken.append((key, delay)))
    return fo, woken


def test_replacements_of_workers_that_die_young_back_off_doubling_to_the_cap(clock: _Clock) -> None:
    fo, woken = _backoff_failover()
    owner = ("ns/a", "svc")
    waits = []
    for i in range(6):
        assert fo.observe(owner, f"p{i}", "process-exited", "n1", lived=2.0)
        allowed, later = fo.allowance(owner, 1, desired=1)
        wait = fo.backoffs[owner].until - clock.now if not allowed else 0.0
        waits.append(wait)
        assert later == 0.0  # the backoff is not the token buckets' pacing: the service is woken instead
        if not allowed:
            assert woken[-1] == ("ns/a", pytest.approx(wait))
            clock.now += wait
            assert fo.allowance(owner, 1, desired=1) == (1, 0.0)
        fo.replaced(owner, [f"r{i}"])
        clock.now += 2.0  # the replacement lives 2 s, then dies
    # The first early death is replaced at once, as the kubelet restarts a container the first time.
    assert waits == [0.0, 10.0, 20.0, 40.0, 40.0, 40.0]


def test_deaths_while_the_service_waits_do_not_double_the_wait(clock: _Clock) -> None:
    fo, _ = _backoff_failover()
    owner = ("ns/a", "svc")
    for i in range(5):  # five replicas die young together
        fo.observe(owner, f"p{i}", "pod-failed", "n1", lived=1.0)
        clock.now += 0.1
    backoff = fo.backoffs[owner]
    assert backoff.waits == 1
    assert backoff.delay == 20.0  # the next wait, not yet started
    assert fo.allowance(owner, 5, desired=5) == (0, 0.0)
    assert "5 replacement(s) wait until" in (fo.degraded(owner) or "")
    assert "CrashLoopBackOff" in (fo.degraded(owner) or "")
    assert fo.replacing(owner).startswith("its replacement waits for the crash-loop backoff")
    clock.now = backoff.until
    assert fo.allowance(owner, 5, desired=5) == (5, 0.0)


def test_a_node_loss_during_a_backoff_is_replaced_at_once(clock: _Clock) -> None:
    fo, _ = _backoff_failover()
    owner = ("ns/a", "svc")
    fo.observe(owner, "p0", "crash-loop", "n1", lived=5000.0)  # crash-looping under the kubelet: young
    fo.observe(owner, "p1", "crash-loop", "n1", lived=5000.0)
    fo.observe(owner, "p2", "node-deleted", "n2")
    assert fo.allowance(owner, 3, desired=3) == (1, 0.0)
    fo.replaced(owner, ["r0"])
    # The node loss was the one replaced: both early deaths still wait.
    assert sorted(fo.pending[owner]) == ["p0", "p1"]


def test_a_worker_that_lived_long_enough_resets_the_backoff(clock: _Clock) -> None:
    fo, _ = _backoff_failover()
    owner = ("ns/a", "svc")
    fo.observe(owner, "p0", "process-exited", lived=1.0)
    fo.observe(owner, "p1", "process-exited", lived=1.0)
    assert fo.allowance(owner, 2, desired=2) == (0, 0.0)  # both wait
    fo.observe(owner, "p2", "process-exited", lived=100.0)  # lived the reset time: not young
    assert owner not in fo.backoffs
    assert fo.allowance(owner, 3, desired=3) == (3, 0.0)


def test_backoff_states_are_said_once_when_they_begin_and_once_when_they_end(clock: _Clock) -> None:
    fo, woken = _backoff_failover()
    owner = ("ns/a", "svc")
    in_backoff = _backoff_services()
    fo.observe(owner, "p0", "process-exited", lived=1.0)
    assert fo.review(owner) == []  # one early death is not a crash loop: replaced at once, nothing said
    fo.observe(owner, "p1", "process-exited", lived=1.0)
    [(kind, reason, message)] = fo.review(owner)
    assert (kind, reason) == ("Warning", "CrashLoopBackOff")
    assert "pod p1 process-exited after 1s" in message
    assert _backoff_services() == in_backoff + 1
    # Woken when it may end: no early death for the reset time.
    assert woken[-1] == ("ns/a", pytest.approx(100.1))
    clock.now += 10.0
    fo.observe(owner, "p2", "process-exited", lived=1.0)  # another wait starts: not a new state
    assert fo.review(owner) == []
    clock.now += 99.0
    assert fo.review(owner) == []
    clock.now += 2.0
    [(kind, reason, message)] = fo.review(owner)
    assert (kind, reason) == ("Normal", "CrashLoopBackOffEnded")
    assert _backoff_services() == in_backoff
    assert fo.review(owner) == []
    assert fo.owners("ns/a") == {owner}  # the losses are still owed
    fo.forget_service(owner)
    assert fo.owners("ns/a") == set()


def test_workers_on_a_not_ready_node_are_noted_until_the_grace_ends_and_a_pause_is_said_once(
    clock: _Clock,
) -> None:
    fo, woken = _backoff_failover()
    owner = ("ns/a", "svc")
    ends = datetime.now(UTC) + timedelta(seconds=30)
    assert fo.review(owner, grace={"n1": ends}) == []
    assert "NotReady node(s) n1" in (fo.degraded(owner) or "")
    assert woken[-1][1] == pytest.approx(30.1, abs=1.0)
    paused = "3 of 3 nodes are NotReady"
    [(kind, reason, message)] = fo.review(owner, paused=paused, kept={"p0": "n1"})
    assert (kind, reason) == ("Warning", "FailoverPaused")
    assert paused in message
    assert "p0 on n1" in message
    assert "NotReady node(s)" not in (fo.degraded(owner) or "")  # the grace is over
    assert "FailoverPaused" in (fo.degraded(owner) or "")
    assert fo.review(owner, paused=paused, kept={"p0": "n1", "p1": "n2"}) == []
    assert fo.in_state("FailoverPaused") == {"ns/a"}
    [(kind, reason, _)] = fo.review(owner)
    assert (kind, reason) == ("Normal", "FailoverResumed")
    assert fo.degraded(owner) is None
    assert fo.in_state("FailoverPaused") == set()


def test_no_compatible_node_is_said_when_it_begins_only() -> None:
    fo = Failover()
    owner = ("ns/a", "svc")
    msg = "service svc: no Ready node matches checkpoint c"
    assert fo.report(owner, "NoCompatibleNode", msg) == ("Warning", "NoCompatibleNode", msg)
    assert fo.report(owner, "NoCompatibleNode", msg) is None
    assert fo.report(owner, "NoCompatibleNode", None) is None
    assert fo.report(owner, "NoCompatibleNode", msg) is not None
    assert fo.degraded(owner) is None  # the reconcile reports it in status itself


def test_node_and_pod_times() -> None:
    down = {
        "metadata": {"name": "n"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-12-01T10:00:00Z"}
            ]
        },
        "spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "timeAdded": "2026-12-01T09:00:00Z"}]},
    }
    assert unhealthy_since(down) == datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    tainted = {**down, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert unhealthy_since(tainted) == datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    assert unhealthy_since({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}) is None
    now = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)
    pod = {
        "metadata": {"creationTimestamp": "2026-12-01T10:00:00Z"},
        "status": {"startTime": "2026-12-01T10:00:20Z"},
    }
    assert worker_lifetime(pod, now) == 10.0
    assert worker_lifetime({**pod, "status": {}}, now) == 30.0
    assert worker_lifetime({"metadata": {}}, now) is None


def test_backoff_settings_are_checked() -> None:
    with pytest.raises(
        ValueError, match=r"crashBackoffInitialSeconds \(400\) is above crashBackoffMaxSeconds"
    ):
        ControllerConfig(crash_backoff_initial_seconds=400)


def _backoff_services() -> float:
    return REGISTRY.get_sample_value("dynsnap_failover_backoff_services") or 0.0
