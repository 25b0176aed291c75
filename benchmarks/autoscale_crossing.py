"""Metric crossing -> restore pod created, measured end to end on the local cluster with a real Prometheus.

The real controller (DGD reconciler + autoscaler, in-process) against the local control plane (etcd,
apiserver, scheduler, controller-manager, kwok GPU nodes); a DGD that restores from a Ready checkpoint;
a DynamoScalingPolicy on `sum(vllm:num_requests_waiting)` at 10 per replica with the default 2 s
evaluation interval; a fake vLLM exporter scraped by Prometheus every second. Each sample raises the
waiting count by one replica's worth, notes when Prometheus first answers the new value (the crossing
as the autoscaler can see it) and when the new pod exists (the benchmark lists pods every 20 ms).

    .venv/bin/python benchmarks/autoscale_crossing.py --samples 20

Writes `crossing_to_pod_p95_s` (and the samples) into the JSON, keeping what autoscale_trace.py wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.controller_scale import (  # noqa: E402
    SERVICE,
    bench_pods,
    latency_stats,
    make_client,
    seed_bench_graph,
)
from dynamo_snapshot.autoscale.prometheus import PrometheusError, PrometheusSource  # noqa: E402
from dynamo_snapshot.cli.controller_cmd import build_controller  # noqa: E402
from dynamo_snapshot.controller.manager import ControllerConfig  # noqa: E402
from dynamo_snapshot.kube import Kube  # noqa: E402
from dynamo_snapshot.kube.kinds import SCALING_POLICY  # noqa: E402
from dynamo_snapshot_dev.localcluster import LocalCluster, LocalPrometheus  # noqa: E402
from tests.autoscale.exporter import FakeVllmExporter  # noqa: E402

NS = "autoscale-bench"
WAITING = "vllm:num_requests_waiting"
QUERY = f"sum({WAITING})"
PER_REPLICA = 10


def policy(url: str, max_replicas: int, interval: float) -> dict[str, Any]:
    return {
        "apiVersion": SCALING_POLICY.api_version,
        "kind": SCALING_POLICY.kind,
        "metadata": {"name": "bench"},
        "spec": {
            "target": {"dgdName": "bench", "serviceName": SERVICE},
            "minReplicas": 1,
            "maxReplicas": max_replicas,
            "metrics": [{"name": "waiting", "query": QUERY, "targetPerReplica": PER_REPLICA}],
            "evaluationIntervalSeconds": interval,
            # Each sample adds one replica's worth of load; past 10 replicas that is within the default
            # 10% tolerance, which would (rightly) do nothing. The latency measured is the mechanism's.
            "tolerance": 0,
            "prometheusUrl": url,
        },
    }


async def pod_count(kube: Kube) -> int:
    return len(await bench_pods(kube, NS))


async def until(check: Any, within: float, every: float = 0.02) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic()
        await asyncio.sleep(every)
    raise TimeoutError(f"not within {within}s")


async def bench(cluster: LocalCluster, prom: LocalPrometheus, exporter: FakeVllmExporter, args: Any) -> Any:
    api = await make_client(cluster.kubeconfig)
    async with api:
        kube = Kube(api, field_manager="bench")
        await seed_bench_graph(kube, NS, nodes=2, gpus=32, pods=64, replicas=1)
        exporter.set(WAITING, 0)
        await kube.create(SCALING_POLICY, policy(prom.url, args.samples + 2, args.interval), NS)

        config = ControllerConfig(namespace=NS, leader_elect=False, metrics_port=0)
        stop = asyncio.Event()
        controller = build_controller(kube, config)
        task = asyncio.create_task(controller.run_until(stop))
        source = PrometheusSource(prom.url, timeout_s=2)
        try:
            await until(lambda: _has(kube, 1), within=60)
            samples = []
            for n in range(1, args.samples + 1):
                # Settle: the last pod exists and Prometheus has the last value.
                await asyncio.sleep(args.interval)
                want = (n + 1) * PER_REPLICA
                exporter.set(WAITING, want)
                crossed = await until(lambda w=want: _prom_sees(source, w), within=15)
                created = await until(lambda k=n + 1: _has(kube, k), within=30)
                samples.append(round(created - crossed, 3))
                print(f"sample {n}: {samples[-1]:.3f} s", flush=True)
            return samples
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def _has(kube: Kube, n: int) -> bool:
    return await pod_count(kube) >= n


async def _prom_sees(source: PrometheusSource, value: float) -> bool:
    try:
        return await source.query_total(QUERY) == value
    except PrometheusError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--interval", type=float, default=2.0, help="the policy's evaluation interval")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "autoscale-trace.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autoscale-crossing-"))
    cluster = LocalCluster(work / "cluster")
    exporter = FakeVllmExporter(["worker-0"])
    prom = LocalPrometheus([exporter.address], workdir=work / "prometheus")
    try:
        cluster.start()
        cluster.install_crds()
        prom.start()
        prom.wait_targets_up()
        samples = asyncio.run(bench(cluster, prom, exporter, args))
    finally:
        prom.stop()
        exporter.stop()
        cluster.stop()
    stats = latency_stats(samples)
    print(json.dumps(stats))
    doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc["crossing_to_pod_p95_s"] = stats["p95_s"]
    doc["crossing_to_pod"] = {
        **stats,
        "samples_s": samples,
        "evaluation_interval_s": args.interval,
        "scrape_interval_s": 1.0,
        "command": f"benchmarks/autoscale_crossing.py --samples {args.samples} --interval {args.interval}",
        "measured": "from Prometheus first answering the new value to the new pod existing (list)",
    }
    notes = [n for n in doc.get("notes", []) if "crossing_to_pod_p95_s is null" not in n]
    doc["notes"] = [*notes, "crossing_to_pod_p95_s: measured on the local cluster by autoscale_crossing.py."]
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
