"""Which GPUs a checkpoint records and a restore goes onto, and whether they can hold the worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from pydantic import JsonValue

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.weights import gpu_memory_problem
from dynamo_snapshot.artifact import GpuInfo
from dynamo_snapshot.cuda import (
    CudaError,
    cuda_available,
    gpu_memory_by_pid,
    list_gpus,
    node_gpus,
    parse_gpu_uuid,
)

log = logging.getLogger(__name__)

__all__ = [
    "assigned_gpus",
    "check_gpu_memory",
    "container_gpus",
    "gpu_memory_held_mib",
    "gpu_models",
    "gpu_remap",
    "local_gpus",
]


def local_gpus() -> GpuInfo | None:
    """This node's GPUs as the manifest records them; None on a node without NVIDIA GPUs."""
    if not cuda_available():
        return None
    try:
        gpus = node_gpus()
    except CudaError as e:
        log.warning("no GPU inventory", extra={"error": str(e)})
        return None
    return GpuInfo.model_validate(dataclasses.asdict(gpus))


def container_gpus(node: GpuInfo | None, visible: tuple[str, ...] | None) -> GpuInfo | None:
    """The GPUs a container was given (``visible``: UUIDs, or indices of the node's GPUs), as a checkpoint
    records them: a worker given 2 of a node's 8 GPUs was taken on 2, and its restore needs 2. The node's
    where its runtime does not say; None for a container given none. AgentError for an index the node
    does not have."""
    if node is None or visible is None:
        return node
    uuids: list[str] = []
    for token in visible:
        if token.isdigit():
            index = int(token)
            if index >= len(node.uuids):
                raise AgentError(
                    f"the container was given GPU {index} (NVIDIA_VISIBLE_DEVICES); this node has "
                    f"{len(node.uuids)}"
                )
            uuids.append(node.uuids[index])
        else:
            uuids.append(token)
    if not uuids:
        return None
    return node.model_copy(update={"uuids": uuids, "count": len(uuids)})


def assigned_gpus(
    node: GpuInfo | None, visible: tuple[str, ...] | None, checkpoint: GpuInfo | None
) -> GpuInfo | None:
    """The GPUs a restore goes onto: the container's (``visible``: UUIDs, or indices of the node's GPUs)
    where its runtime says, else the node's. AgentError when they cannot hold the checkpoint's."""
    if node is None or visible is None or checkpoint is None:
        return node
    given = container_gpus(node, visible)
    count = given.count if given is not None else 0
    if count < checkpoint.count:
        raise AgentError(
            f"the restore container was given {count} GPU(s) (NVIDIA_VISIBLE_DEVICES); the checkpoint "
            f"was taken on {checkpoint.count}"
        )
    return given


def gpu_remap(source: GpuInfo | None, target: GpuInfo | None) -> dict[str, str]:
    """Old GPU UUID -> new one for every checkpointed GPU (the driver wants all or none); none when the
    restore lands on the very GPUs it was taken on."""
    if source is None or target is None or list(source.uuids) == list(target.uuids[: len(source.uuids)]):
        return {}
    return dict(zip(source.uuids, target.uuids, strict=False))


def gpu_models(uuids: Sequence[str], nvml: Any | None = None) -> list[str] | None:
    """The model of each GPU ``uuids`` names, as nvidia-smi reports it: NVML's device name (a manifest
    records GPU feature discovery's gpu.product, each space made '-', which cannot be turned back). None
    unless NVML names every one of them: no NVML, or a UUID of no whole GPU here (a MIG slice, another
    node's). ``nvml`` replaces the pynvml module (tests)."""
    if not uuids:
        return None
    try:
        names = {parse_gpu_uuid(g.uuid): g.name for g in list_gpus(nvml)}
        found = [names.get(parse_gpu_uuid(u)) for u in uuids]
    except Exception as e:
        # Past nvmlInit pynvml raises its own NVMLError types (not CudaError); a model is a note for
        # people, never worth failing the caller over.
        log.info("no GPU models", extra={"error": str(e)})
        return None
    models = [name for name in found if name]
    return models if len(models) == len(uuids) else None


def gpu_memory_held_mib(pids: list[int]) -> int:
    """GPU memory the worker's CUDA processes hold (after their own releases); 0 when NVML cannot say."""
    if not pids:
        return 0
    try:
        used = gpu_memory_by_pid()
    except CudaError as e:
        log.warning("no per-process GPU memory", extra={"error": str(e)})
        return 0
    return sum(used.get(pid, 0) for pid in pids)


async def check_gpu_memory(
    extra: dict[str, JsonValue], target: GpuInfo | None, checkpoint: GpuInfo | None
) -> None:
    """AgentError before anything starts when the GPUs the restore goes onto (``target``) cannot hold
    what the worker had at checkpoint (as the manifest's ``extra.gpuMemory`` records it)."""
    need = extra.get("gpuMemory")
    if target is None or checkpoint is None or not isinstance(need, dict):
        return
    held, released = need.get("heldMiB"), need.get("releasedMiB")
    if not isinstance(held, int) or not isinstance(released, int):
        return
    try:
        gpus = await asyncio.to_thread(list_gpus)
    except CudaError as e:
        log.warning("cannot read free GPU memory; restoring anyway", extra={"error": str(e)})
        return
    by_uuid = {g.uuid: g for g in gpus}
    # The container's GPUs where they are known by UUID (not the node's first ones); else in node order.
    if target.uuids and all(u in by_uuid for u in target.uuids):
        gpus = [by_uuid[u] for u in target.uuids]
    problem = gpu_memory_problem([g.memory_free_mib for g in gpus][: checkpoint.count], held, released)
    if problem:
        raise AgentError(problem)
