"""Failover bookkeeping and pacing: pure logic."""

from __future__ import annotations

from dynamo_snapshot.controller.failover import Failover, TokenBucket, loss_cause, node_healthy


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
    fo.replaced(owner, 2)
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
