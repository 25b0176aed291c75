"""Which GPUs a restore into a kubelet pod goes onto: the ones the device plugin gave the restore
container (NVIDIA_VISIBLE_DEVICES), not simply the node's first ones. Pure logic."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import JsonValue

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.gpu_assignment import assigned_gpus, check_gpu_memory, container_gpus, gpu_remap
from dynamo_snapshot.agent.runtime.container_gpus import container_gpus_given, visible_gpus
from dynamo_snapshot.artifact import GpuInfo

NODE = GpuInfo(
    product="NVIDIA-H200",
    cuda_driver_major="580",
    count=4,
    uuids=[f"GPU-node-{i}" for i in range(4)],
)
CHECKPOINT = GpuInfo(product="NVIDIA-H200", cuda_driver_major="580", count=1, uuids=["GPU-source-0"])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("all", None),
        ("", None),
        ("none", ()),
        ("void", ()),
        ("2", ("2",)),
        ("GPU-a, GPU-b", ("GPU-a", "GPU-b")),
        ("MIG-x", ("MIG-x",)),
    ],
)
def test_visible_gpus_reads_the_device_plugins_variable(value: str | None, expected: object) -> None:
    env = {} if value is None else {"NVIDIA_VISIBLE_DEVICES": value}
    assert visible_gpus(env) == expected


@pytest.mark.parametrize(
    ("env", "devices", "expected"),
    [
        ({}, [], ()),  # no device plugin, no CDI: a pod that never asked for a GPU
        ({}, ["/dev/fuse"], ()),
        ({}, ["/dev/nvidiactl", "/dev/nvidia-uvm"], ()),  # the control nodes alone are no GPU
        ({}, ["/dev/nvidiactl", "/dev/nvidia3"], None),  # CDI injected a GPU without the variable
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, [], None),  # the legacy runtime hook injects them later
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-a"}, [], ("GPU-a",)),
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, ["/dev/nvidia0"], ()),
    ],
)
def test_a_container_without_a_gpu_device_or_variable_was_given_none(
    env: dict[str, str], devices: list[str], expected: object
) -> None:
    config: dict[str, object] = {"linux": {"devices": [{"path": p, "type": "c"} for p in devices]}}
    assert container_gpus_given(env, config) == expected
    if expected == ():
        with pytest.raises(AgentError, match="given 0 GPU"):
            assigned_gpus(NODE, container_gpus_given(env, config), CHECKPOINT)


def test_the_restore_goes_onto_the_containers_gpu_by_index_or_uuid() -> None:
    by_index = assigned_gpus(NODE, ("2",), CHECKPOINT)
    assert by_index is not None
    assert by_index.uuids == ["GPU-node-2"]
    assert gpu_remap(CHECKPOINT, by_index) == {"GPU-source-0": "GPU-node-2"}
    by_uuid = assigned_gpus(NODE, ("GPU-node-3",), CHECKPOINT)
    assert by_uuid is not None
    assert gpu_remap(CHECKPOINT, by_uuid) == {"GPU-source-0": "GPU-node-3"}


def test_without_an_assignment_the_nodes_gpus_are_used() -> None:
    assert assigned_gpus(NODE, None, CHECKPOINT) == NODE
    assert gpu_remap(CHECKPOINT, NODE) == {"GPU-source-0": "GPU-node-0"}
    assert assigned_gpus(NODE, ("1",), None) == NODE  # a CPU checkpoint needs no GPU


def test_an_assignment_that_cannot_hold_the_checkpoint_is_refused() -> None:
    with pytest.raises(AgentError, match="given 0 GPU"):
        assigned_gpus(NODE, (), CHECKPOINT)
    with pytest.raises(AgentError, match=r"given GPU 7 .*this node has 4"):
        assigned_gpus(NODE, ("7",), CHECKPOINT)
    two = CHECKPOINT.model_copy(update={"count": 2, "uuids": ["GPU-s0", "GPU-s1"]})
    with pytest.raises(AgentError, match=r"given 1 GPU.*taken on 2"):
        assigned_gpus(NODE, ("1",), two)


def test_a_checkpoint_records_the_gpus_its_container_was_given() -> None:
    # Two of the node's four: the checkpoint was taken on two, and needs two to restore.
    two = container_gpus(NODE, ("1", "GPU-node-3"))
    assert two is not None
    assert (two.count, two.uuids, two.product) == (2, ["GPU-node-1", "GPU-node-3"], "NVIDIA-H200")
    assert container_gpus(NODE, None) == NODE  # the runtime does not say: the node's
    assert container_gpus(NODE, ()) is None  # given none
    assert container_gpus(None, ("0",)) is None  # a node without GPUs
    with pytest.raises(AgentError, match=r"given GPU 9 .*this node has 4"):
        container_gpus(NODE, ("9",))
    # Restored onto two other GPUs of the node, each source GPU maps onto one of them.
    target = assigned_gpus(NODE, ("0", "2"), two)
    assert gpu_remap(two, target) == {"GPU-node-1": "GPU-node-0", "GPU-node-3": "GPU-node-2"}
    with pytest.raises(AgentError, match=r"given 1 GPU.*taken on 2"):
        assigned_gpus(NODE, ("0",), two)


def test_the_memory_check_reads_the_gpus_the_restore_goes_onto(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynamo_snapshot.agent import gpu_assignment
    from dynamo_snapshot.cuda import inventory

    free = [1_000, 1_000, 80_000, 80_000]
    gpus = [
        inventory.GpuInfo(i, f"GPU-node-{i}", "NVIDIA H200", "NVIDIA-H200", 143_771, f)
        for i, f in enumerate(free)
    ]
    monkeypatch.setattr(gpu_assignment, "list_gpus", lambda: gpus)
    two = CHECKPOINT.model_copy(update={"count": 2, "uuids": ["GPU-s0", "GPU-s1"]})
    need: dict[str, JsonValue] = {"gpuMemory": {"heldMiB": 100_000, "releasedMiB": 20_000}}
    # The container was given the node's last two GPUs, which hold it; its first two would not.
    asyncio.run(check_gpu_memory(need, assigned_gpus(NODE, ("2", "3"), two), two))
    with pytest.raises(AgentError, match=r"2000 MiB free on 2 GPU"):
        asyncio.run(check_gpu_memory(need, assigned_gpus(NODE, ("0", "1"), two), two))
    # GPUs known by no UUID NVML lists (MIG): the node's, in order.
    mig = NODE.model_copy(update={"uuids": ["MIG-a", "MIG-b"], "count": 2})
    with pytest.raises(AgentError, match=r"2000 MiB free"):
        asyncio.run(check_gpu_memory(need, mig, two))
