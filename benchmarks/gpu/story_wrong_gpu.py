"""The pod story's last bad input: a scale-up restore from an artifact whose manifest records another GPU
product than the node's (an H100's checkpoint offered to an H200 node, say).

One machine has one GPU model, so the story makes such an artifact the way an operator's mistake or a
copied store would: it rewrites the product in the checkpoint's sealed manifest, seals it again, and
records the new digest where a restore is granted from (the PodSnapshotContent's and the
DynamoCheckpoint's status, as the cluster's admin). The controller still places the restore pod on the
node (the checkpoint's status keeps the node's product), so the refusal must come from the agent, the
last check before a byte is read: the pod's Restored condition False with the reason, an Event, no
worker process, and the controller replacing the pod with a cold start.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from dynamo_snapshot.api.views import CheckpointView, PodSnapshotView
from dynamo_snapshot.artifact.manifest import DIGEST_FIELD, MANIFEST_NAME, canonical_digest

__all__ = ["OTHER_PRODUCT", "events_about", "kubectl", "kubectl_json", "reseal_for_another_gpu"]

OTHER_PRODUCT = "NVIDIA-A100-SXM4-80GB"


def reseal_for_another_gpu(manifest: Path) -> tuple[str, str]:
    """Rewrite ``manifest`` to record ``OTHER_PRODUCT`` (a CPU checkpoint gets one such GPU, which the node
    lacks), sealed again; (old digest, new digest)."""
    raw: dict[str, Any] = json.loads(manifest.read_text())
    old = str(raw.get(DIGEST_FIELD))
    gpus = raw.get("gpus") or {"count": 1, "cuda_driver_major": "580"}
    raw["gpus"] = {**gpus, "product": OTHER_PRODUCT}
    raw[DIGEST_FIELD] = canonical_digest(raw)
    manifest.chmod(0o644)
    manifest.write_text(json.dumps(raw, indent=1))
    return old, raw[DIGEST_FIELD]


async def kubectl(cluster: Any, *args: str) -> str:
    """kubectl off the event loop: the controller and agent under test run on the story's loop."""
    return str((await asyncio.to_thread(cluster.kubectl, *args)).stdout)


async def kubectl_json(cluster: Any, *args: str) -> Any:
    return json.loads(await kubectl(cluster, *args, "-o", "json"))


def _find_manifest(artifacts: Path, digest: str) -> Path:
    for path in artifacts.rglob(MANIFEST_NAME):
        try:
            if json.loads(path.read_text()).get(DIGEST_FIELD) == digest:
                return path
        except (OSError, ValueError):
            continue
    raise RuntimeError(f"no manifest under {artifacts} has the digest {digest}")


async def artifact_from_another_gpu(
    cluster: Any, artifacts: Path, namespace: str, scale_to: Any, pods: Any
) -> dict[str, Any]:
    """Reseal the checkpoint's artifact for another GPU, scale up by one, and report what became of the
    restore pod the controller made. ``scale_to()`` adds the replica; ``pods()`` gives the story's
    ``PodTimes`` of the pods seen so far, by name."""
    ckpt = next(
        CheckpointView(c)
        for c in (await kubectl_json(cluster, "get", "dynamocheckpoints", "-n", namespace))["items"]
        if CheckpointView(c).phase == "Ready"
    )
    snap = PodSnapshotView(
        await kubectl_json(cluster, "get", "podsnapshots", "-n", namespace, ckpt.pod_snapshot_name)
    )
    manifest = await asyncio.to_thread(_find_manifest, artifacts, ckpt.artifact_digest)
    old, new = await asyncio.to_thread(reseal_for_another_gpu, manifest)
    for kind, name, where, status in (
        ("podsnapshotcontents", snap.bound_content, [], {"artifact": {"digest": new}}),
        ("dynamocheckpoints", ckpt.meta.name, ["-n", namespace], {"artifactDigest": new}),
    ):
        patch = json.dumps({"status": status})
        await kubectl(
            cluster, "patch", kind, name, *where, "--subresource=status", "--type=merge", "-p", patch
        )
    before = set(pods())
    await scale_to()
    found: dict[str, Any] = {"manifest": str(manifest), "old_digest": old, "new_digest": new}
    deadline = time.monotonic() + 120
    refused = cold = None
    while time.monotonic() < deadline:
        new_pods = {n: p for n, p in pods().items() if n not in before}
        refused = next((p for p in new_pods.values() if p.mode == "restore"), None)
        cold = next((p for p in new_pods.values() if p.mode == "cold"), None)
        # The controller deletes the refused pod once its replacement exists.
        if refused is not None and cold is not None and refused.restored_condition and refused.gone:
            break
        await asyncio.sleep(0.5)
    if refused is not None:
        found["restored_condition"] = refused.restored_condition
        found["restore_pod_gone"] = refused.gone is not None
        found["restore_pod_serving"] = refused.serving is not None
    found["replaced_by_cold_pod"] = None if cold is None else cold.name
    found["restore_pod"] = None if refused is None else refused.name
    found["events"] = [] if refused is None else await events_about(cluster, namespace, refused.name)
    return found


async def events_about(cluster: Any, namespace: str, pod: str) -> list[str]:
    """The namespace's Events on ``pod`` or naming it (the graph's, when the controller replaces it)."""
    shown = []
    for e in (await kubectl_json(cluster, "get", "events", "-n", namespace))["items"]:
        about = e.get("involvedObject") or {}
        if about.get("name") == pod or pod in (e.get("message") or ""):
            shown.append(f"{about.get('kind')}/{about.get('name')} {e.get('reason')}: {e.get('message')}")
    return shown
