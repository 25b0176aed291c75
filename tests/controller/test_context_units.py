"""Node questions the reconcilers ask the context: pure logic over the node cache."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.checkpoint import CheckpointCompatibility
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.kube import Obj
from tests.helpers.controller_context import bare_context


class _Nodes:
    """The part of the node informer the node questions read."""

    def __init__(self, nodes: list[Obj]) -> None:
        self.nodes = nodes

    def list(self) -> list[Obj]:
        return list(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


def _node(name: str, product: str, *, ready: bool = True, cordoned: bool = False) -> Obj:
    return {
        "metadata": {"name": name, "labels": {protocol.LABEL_GPU_PRODUCT: product}},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _context(nodes: list[Obj]) -> Context:
    return bare_context(nodes=_Nodes(nodes))  # the node questions touch nothing else


def test_both_node_questions_count_only_ready_schedulable_nodes() -> None:
    ctx = _context(
        [
            _node("a", "NVIDIA-H200"),
            _node("b", "NVIDIA-H200", ready=False),
            _node("c", "NVIDIA-L40S"),
            _node("d", "NVIDIA-H200", cordoned=True),
        ]
    )
    h200 = CheckpointCompatibility(gpu_product="NVIDIA-H200")
    # A checkpoint that states no requirement fits any Ready node, but only those.
    assert ctx.compatible_nodes(None) == 2
    assert ctx.other_compatible_node(None, {"a"})
    assert not ctx.other_compatible_node(None, {"a", "c"})
    assert ctx.compatible_nodes(h200) == 1
    assert ctx.other_compatible_node(h200, set())
    assert not ctx.other_compatible_node(h200, {"a"})
    for compat in (None, h200, CheckpointCompatibility(gpu_product="NVIDIA-A100")):
        assert ctx.other_compatible_node(compat, set()) == (ctx.compatible_nodes(compat) > 0)


def _down(name: str, product: str, seconds_ago: float, *, cordoned: bool = False) -> Obj:
    node = _node(name, product, ready=False, cordoned=cordoned)
    since = datetime.now(UTC) - timedelta(seconds=seconds_ago)
    node["status"]["conditions"][0]["lastTransitionTime"] = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    return node


def test_a_fitting_node_inside_its_grace_is_one_a_restore_waits_for() -> None:
    nodes = [
        _down("inside", "NVIDIA-H200", 10),
        _down("past", "NVIDIA-H200", 400),  # the default grace is 300 s
        _down("other-gpus", "NVIDIA-L40S", 10),
        _down("cordoned", "NVIDIA-H200", 10, cordoned=True),
        *(_node(f"up-{i}", "NVIDIA-L40S") for i in range(4)),  # 4 of 8 down: failover not paused
    ]
    ctx = _context(nodes)
    assert ctx.node_health().paused is None
    h200 = CheckpointCompatibility(gpu_product="NVIDIA-H200")
    waits = ctx.compatible_nodes_in_grace(h200)
    assert list(waits) == ["inside"]
    assert timedelta(seconds=285) < waits["inside"] - datetime.now(UTC) <= timedelta(seconds=290)
    assert ctx.compatible_nodes(h200) == 0
    # Most nodes down at once: failover is paused and keeps their workers, so a restore waits for any.
    ctx = _context([*nodes[:4], _down("also", "NVIDIA-L40S", 10), *nodes[4:6]])
    assert ctx.node_health().paused is not None
    assert sorted(ctx.compatible_nodes_in_grace(h200)) == ["inside", "past"]
