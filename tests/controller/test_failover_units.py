"""Failover bookkeeping and pacing: pure logic."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.failover import Failover, TokenBucket, loss_cause, node_healthy
from dynamo_snapshot.controller.pods import unschedulable
from dynamo_snapshot.controller.podspec import keep_off_nodes


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
        fo.observe(owner, f"p{i}", "pod-failed", f"n{i}")
    fo.observe(other, "q0", "pod-failed", "n9")
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
    fo.observe(a, "a0", "pod-failed", "n1")
    assert fo.allowance(a, 1, desired=4) == (1, 0.0)  # replaced while a's checkpoint was Ready
    fo.replaced(a, ["ra0"])
    for i in range(1, 4):
        fo.observe(a, f"a{i}", "pod-failed", "n1")  # 3 of 4 lost while a waits for its checkpoint
    fo.settle(a, 3, waiting=True)
    assert _pending(fo, a) == ["a1", "a2", "a3"]
    assert fo.held_back(a)
    assert "wait for its checkpoint" in (fo.degraded(a) or "")
    assert fo.replacing(a) == "its replacement waits for the service's checkpoint"
    assert fo.replacing(b) == "replacing it"
    # a ranks first (75% lost), but cannot use tokens now: none are held back from b for it.
    fo.observe(b, "b0", "pod-failed", "n1")
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
