"""Restore pod created -> worker serving on its pod IP, on the real kubelet node (CPU reference worker).

The local cluster with its real node (kubelet + containerd + runc), the controller and the node agent
(runtime containerd) in-process. The graph's Auto-mode checkpoint is taken once; then, one at a time,
``--restores`` restore pods of it are created and timed from the create call returning to the first
``GET /health`` on the pod's IP that answers 200 (polled every 10 ms from the host), and deleted again.

Where the time goes, per restore: ``placeholder`` (create -> the standby placeholder says it waits: the
scheduler's binding, the kubelet's sandbox with its CNI network, the container and the placeholder's own
start), ``agent_wait`` (the placeholder waiting -> the agent's restore starts), the agent's phases
(``verify``: the artifact's manifest and checksums; ``rootfs_diff``; ``criu``: CRIU into the container;
``signal``: restore-complete) and ``serving`` (restore-complete -> the worker answers: its handshake
polling, then opening its listener).

    .venv/bin/python benchmarks/kubelet_restore.py --restores 12 --out benchmarks/results/kubelet-restore.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes_asyncio import client, config  # noqa: E402

from dynamo_snapshot.agent.timings import AWAIT_CONTAINER_PHASE  # noqa: E402
from dynamo_snapshot.agent.watcher import workload_key  # noqa: E402
from dynamo_snapshot.api import protocol  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402
from dynamo_snapshot.kube import POD, Kube  # noqa: E402
from dynamo_snapshot.kube.dgd_versions import DgdClient  # noqa: E402
from dynamo_snapshot.workload import parse_restore_complete  # noqa: E402
from dynamo_snapshot_dev.localcluster import LocalCluster  # noqa: E402
from tests.helpers.kubelet_stack import (  # noqa: E402
    GRAPH,
    Stack,
    checkpointed_graph,
    restore_pod,
    serving,
)

NAMESPACE = "kubelet-bench"


async def _one(s: Stack, name: str, dgd: dict[str, Any], ckpt: dict[str, Any]) -> dict[str, Any]:
    manifest = restore_pod(s, name, dgd, ckpt, s.node.worker_image.name, None, standby=True)
    t0 = time.time()
    created = await s.kube.create(POD, manifest)
    ip = ""
    while True:
        pod = await s.kube.get(POD, name, s.namespace)
        ann = pod["metadata"].get("annotations") or {}
        status = ann.get(protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main"))
        if status == "failed":
            raise RuntimeError(f"{name}: {ann}")
        ip = (pod.get("status") or {}).get("podIP") or ""
        if ip and await asyncio.to_thread(serving, ip):
            break
        await asyncio.sleep(0.01)
    served_at = time.time()
    assert s.runtime is not None
    key = workload_key(created)
    ctl = s.runtime.control_dir(key)
    standby_since = json.loads((ctl / protocol.FILE_RESTORE_STANDBY).read_text())["since"]
    said = parse_restore_complete((ctl / protocol.FILE_RESTORE_COMPLETE).read_text()) or {}
    restored_at = float(said["restoredAt"])
    pod = await s.kube.get(POD, name, s.namespace)
    ann = pod["metadata"]["annotations"]
    agent = json.loads(ann[protocol.ANNOTATION_RESTORE_TIMINGS])
    # restoredAt is written in the executor's last phase ("signal"): it began its other phases earlier
    # (`await_container`, the agent's wait for the container before them, is not one of them).
    executor = {k: v for k, v in agent.items() if k not in (AWAIT_CONTAINER_PHASE, "signal")}
    agent_started = restored_at - sum(executor.values())
    return {
        "pod": name,
        "total_s": served_at - t0,
        "phases_s": {
            "placeholder": standby_since - t0,
            "agent_wait": max(0.0, agent_started - standby_since),
            **{f"agent.{k}": v for k, v in agent.items()},
            **{f"runtime.{k}": v for k, v in s.runtime.restore_phases.get(key, {}).items()},
            "serving": served_at - restored_at,
        },
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main(restores: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kubelet-bench-") as tmp:
        work = Path(tmp)
        lc = LocalCluster(work / "cluster")
        lc.start()
        try:
            lc.install_crds()
            node = lc.start_real_node()
            lc.kubectl("create", "namespace", NAMESPACE)
            cfg = client.Configuration()
            await config.load_kube_config(config_file=str(lc.kubeconfig), client_configuration=cfg)
            async with client.ApiClient(cfg) as api:
                criu = Criu()
                s = Stack(
                    Kube(api, field_manager="bench"), NAMESPACE, node, criu, work / "state", work / "store"
                )
                s.start_controller()
                s.start_agent()
                try:
                    ckpt, _ = await checkpointed_graph(s)
                    dgd = await DgdClient(s.kube).get(GRAPH, NAMESPACE)
                    samples = []
                    for i in range(restores):
                        sample = await _one(s, f"bench-{i}", dgd, ckpt)
                        print(json.dumps(sample), flush=True)
                        samples.append(sample)
                        await s.delete_pod(f"bench-{i}")
                finally:
                    await s.close()
        finally:
            lc.stop_real_node()
            lc.stop()
    totals = [x["total_s"] for x in samples]
    phases = sorted({k for x in samples for k in x["phases_s"]})
    result = {
        "restores": len(samples),
        "total_s": {"p50": statistics.median(totals), "p95": _pct(totals, 0.95), "max": max(totals)},
        "phase_median_s": {k: statistics.median(x["phases_s"].get(k, 0.0) for x in samples) for k in phases},
        "criu": str(await criu.version()),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restores", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main(args.restores))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
