"""The pod story's CDI fault: the node's CDI spec names a device node the machine lacks (a mis-edit, or a
driver reload that took a node away), while a scale-up asks for one more restore.

The device plugin reads the spec again every health interval and marks the GPU unhealthy, so the node
advertises no `nvidia.com/gpu`; the new restore pod must stay Pending, unscheduled, with the scheduler's
reason (no container made, so nothing for the agent to restore into, nothing half-restored). Once the spec
is put back the GPU is healthy again and the same pod is scheduled and restored.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from benchmarks.gpu.story_wrong_gpu import events_about, kubectl_json
from dynamo_snapshot.api.protocol import RESOURCE_GPU
from dynamo_snapshot.api.views import PodView
from dynamo_snapshot_dev.localcluster.realnode.cdi import (
    SPEC_NAME,
    naming_a_missing_device_node,
    replace_spec_file,
)

__all__ = ["MISSING_NODE", "spec_naming_a_missing_device"]

MISSING_NODE = Path("/dev/nvidia-dsnap-missing")


class _Seen(Protocol):
    mode: str
    answers: float | None
    restored_condition: str | None


async def _gpus_advertised(cluster: Any, node: str) -> int:
    status = (await kubectl_json(cluster, "get", "node", node)).get("status") or {}
    return int((status.get("allocatable") or {}).get(RESOURCE_GPU, "0"))


async def _until(what: str, check: Callable[[], Awaitable[Any]], within: float) -> tuple[Any, float]:
    started = time.monotonic()
    while True:
        got = await check()
        if got:
            return got, round(time.monotonic() - started, 2)
        if time.monotonic() - started > within:
            raise TimeoutError(f"{what}: not within {within:.0f} s")
        await asyncio.sleep(0.25)


async def spec_naming_a_missing_device(
    cluster: Any,
    node: str,
    cdi_dir: Path,
    namespace: str,
    scale_up: Callable[[], Awaitable[None]],
    pods: Callable[[], Mapping[str, _Seen]],
) -> dict[str, Any]:
    """Break the spec, scale up by one, report the new pod while the spec is broken and after it is
    fixed. ``pods()`` gives the story's pods seen so far, by name."""
    spec_path = cdi_dir / SPEC_NAME
    good = json.loads(await asyncio.to_thread(spec_path.read_text))
    gpu = next(d["name"] for d in good["devices"] if str(d["name"]).startswith("GPU-"))
    found: dict[str, Any] = {"spec": str(spec_path), "device": gpu, "missing_node": str(MISSING_NODE)}
    before_gpus = await _gpus_advertised(cluster, node)
    await asyncio.to_thread(
        replace_spec_file, spec_path, naming_a_missing_device_node(good, gpu, MISSING_NODE)
    )
    try:

        async def none_advertised() -> bool:
            return await _gpus_advertised(cluster, node) == 0

        _, found["gpus_withdrawn_after_s"] = await _until("nvidia.com/gpu withdrawn", none_advertised, 60)
        found["gpus_advertised"] = {"before": before_gpus, "while_broken": 0}
        before = set(pods())
        await scale_up()

        async def unschedulable() -> PodView | None:
            for name in set(pods()) - before:
                pod = PodView(await kubectl_json(cluster, "get", "pod", "-n", namespace, name))
                if pod.condition("PodScheduled").get("reason") == "Unschedulable":
                    return pod
            return None

        pending, found["unschedulable_after_s"] = await _until("the new pod unschedulable", unschedulable, 60)
        # Long enough for an agent that acted on a pod without a node to show it.
        await asyncio.sleep(5)
        pod = PodView(await kubectl_json(cluster, "get", "pod", "-n", namespace, pending.meta.name))
        cond = pod.condition("PodScheduled")
        found["while_broken"] = {
            "pod": pod.meta.name,
            "mode": pods()[pod.meta.name].mode,
            "phase": pod.phase,
            "node": pod.node_name,
            "scheduled": {k: cond.get(k) for k in ("status", "reason", "message")},
            "restored_condition": pods()[pod.meta.name].restored_condition,
        }
        found["events"] = await events_about(cluster, namespace, pod.meta.name)
    finally:
        await asyncio.to_thread(replace_spec_file, spec_path, good)
    fixed = time.monotonic()

    async def restored() -> _Seen | None:
        seen = pods().get(pending.meta.name)
        return seen if seen is not None and seen.answers is not None else None

    after, _ = await _until("the pod restored once the spec is fixed", restored, 180)
    found["after_fix"] = {
        "mode": after.mode,
        "restored_condition": after.restored_condition,
        "fixed_to_answers_s": round((after.answers or fixed) - fixed, 2),
        "gpus_advertised": await _gpus_advertised(cluster, node),
    }
    return found
