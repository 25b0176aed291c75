"""The node-health questions failover asks the context: when failover pauses, when a node's grace ends,
which nodes a new pod is kept off. Pure logic over the node cache."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from prometheus_client import REGISTRY

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.context import AVOIDED_NODES_MAX, Context
from dynamo_snapshot.controller.failover.node_state import node_down
from dynamo_snapshot.kube import Obj
from tests.helpers.controller_context import bare_context

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class _Nodes:
    def __init__(self, nodes: list[Obj]) -> None:
        self.nodes = nodes

    def list(self) -> list[Obj]:
        return list(self.nodes)


def _node(name: str, *, down_at: datetime | None = None, stamped: bool = True) -> Obj:
    ready: dict[str, Any] = {"type": "Ready", "status": "True"}
    if down_at is not None:
        ready = {"type": "Ready", "status": "Unknown"}
        if stamped:
            ready["lastTransitionTime"] = down_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": name}, "spec": {}, "status": {"conditions": [ready]}}


def _context(nodes: list[Obj], **settings: Any) -> Context:
    return bare_context(nodes=_Nodes(nodes), settings=ControllerConfig(**settings))


@pytest.mark.parametrize(
    ("down", "total", "paused"),
    [
        (1, 1, True),  # no node is Ready: nothing to fail over to, and likely the control plane
        (1, 2, False),
        (2, 2, True),
        (2, 3, False),  # a share of a tiny cluster says little: kube-controller-manager wants 3
        (3, 3, True),
        (3, 5, True),  # 60%
        (3, 6, False),  # 50%
        (6, 10, True),
        (5, 10, False),
        (11, 20, True),  # exactly the threshold (55%): 0.55 * 20 is 11.000000000000002 in floats
    ],
)
def test_failover_pauses_when_most_nodes_are_down(down: int, total: int, paused: bool) -> None:
    nodes = [_node(f"n{i}", down_at=T0 if i < down else None) for i in range(total)]
    health = _context(nodes).node_health()
    assert health.total == total
    assert len(health.down) == down
    assert (health.paused is not None) == paused
    if paused:
        assert f"{down} of {total} nodes are NotReady or unreachable" in (health.paused or "")
        assert REGISTRY.get_sample_value("dynsnap_failover_paused") == 1.0
    else:
        assert REGISTRY.get_sample_value("dynsnap_failover_paused") == 0.0


def test_the_pause_threshold_is_a_setting_and_the_count_follows_node_changes() -> None:
    nodes = [_node(f"n{i}", down_at=T0 if i < 3 else None) for i in range(6)]
    ctx = _context(nodes, unhealthy_nodes_threshold=0.5)
    assert ctx.node_health().paused is not None
    nodes[0] = _node("n0")
    assert ctx.node_health().paused is not None  # cached until a node changes
    ctx.node_changed()
    assert ctx.node_health().paused is None


def test_the_grace_counts_from_the_nodes_own_record_else_from_when_it_was_first_seen_down() -> None:
    stamped, unstamped = _node("a", down_at=T0), _node("b", down_at=T0, stamped=False)
    ctx = _context([stamped, unstamped], node_loss_grace_seconds=300)
    now = T0 + timedelta(seconds=100)
    assert ctx.node_grace_ends(stamped, now) == T0 + timedelta(seconds=300)
    assert ctx.node_grace_ends(unstamped, now) == now + timedelta(seconds=300)
    later = now + timedelta(seconds=50)
    assert ctx.node_grace_ends(unstamped, later) == now + timedelta(seconds=300)  # not restarted
    # Back to Ready and down again: a new grace.
    ctx.nodes = cast(Any, _Nodes([stamped, _node("b")]))
    ctx.node_changed()
    ctx.node_health()
    assert ctx.node_grace_ends(unstamped, later) == later + timedelta(seconds=300)


def test_nodes_still_down_when_a_pause_ends_get_a_fresh_grace() -> None:
    # An outage of all three nodes, long past the grace; the first node back lifts the pause (2 of 3 down
    # is below the 3 that pausing needs) while the others' heartbeats are on their way.
    nodes = [_node(f"n{i}", down_at=T0) for i in range(3)]
    ctx = _context(nodes, node_loss_grace_seconds=300)
    assert ctx.node_health().paused is not None
    outage = T0 + timedelta(seconds=3600)
    assert ctx.node_grace_ends(nodes[1], outage) == T0 + timedelta(seconds=300)
    ctx.nodes = cast(Any, _Nodes([_node("n0"), *nodes[1:]]))
    ctx.node_changed()
    resumed = datetime.now(UTC)
    assert ctx.node_health().paused is None
    ends = ctx.node_grace_ends(nodes[1], resumed)
    assert resumed + timedelta(seconds=299) <= ends <= datetime.now(UTC) + timedelta(seconds=300)
    # A node that goes down after that counts from its own record again.
    ctx.nodes = cast(Any, _Nodes([_node("n0"), _node("n1"), nodes[2], _node("n3", down_at=T0)]))
    ctx.node_changed()
    assert ctx.node_health().paused is None
    assert ctx.node_grace_ends(_node("n3", down_at=T0), resumed) == T0 + timedelta(seconds=300)
    assert ctx.node_grace_ends(nodes[2], resumed) == ends


def test_new_pods_are_kept_off_down_nodes_newest_first_and_only_so_many() -> None:
    many = AVOIDED_NODES_MAX + 8
    nodes = [_node(f"down-{i:03d}", down_at=T0 + timedelta(seconds=i)) for i in range(many)]
    ctx = _context([*nodes, _node("up")])
    spec: dict[str, Any] = {}
    ctx.keep_off_bad_nodes(spec, ["down-039", "up"])
    affinity = spec["affinity"]["nodeAffinity"]
    [term] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    [expr] = term["matchExpressions"]
    assert expr["operator"] == "NotIn"
    assert expr["values"] == sorted(f"down-{i:03d}" for i in range(many - AVOIDED_NODES_MAX, many))
    # Preferred away from the nodes that just lost workers, unless required already.
    [pref] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["preference"]["matchExpressions"][0]["values"] == ["up"]


def test_with_every_node_up_a_new_pod_gets_no_required_affinity() -> None:
    ctx = _context([_node("a"), _node("b")])
    spec: dict[str, Any] = {}
    ctx.keep_off_bad_nodes(spec, [])
    assert spec == {}


def test_only_a_failed_node_is_down() -> None:
    def node(ready: str | None, *taints: str) -> Obj:
        conditions = [{"type": "Ready", "status": ready}] if ready else []
        return {
            "metadata": {"name": "n"},
            "spec": {"taints": [{"key": t, "effect": "NoSchedule"} for t in taints]},
            "status": {"conditions": conditions},
        }

    not_ready, unreachable = "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"
    assert not node_down(node(None, not_ready)), "a node that has not reported yet is joining"
    assert not node_down(node("True", not_ready)), "the not-ready taint outlives Ready=True for a moment"
    assert not node_down(node("True"))
    assert node_down(node("False"))
    assert node_down(node("Unknown", not_ready))
    assert node_down(node(None, unreachable))
    assert node_down(node("True", unreachable))
