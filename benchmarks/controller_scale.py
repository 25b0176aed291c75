#!/usr/bin/env python3
"""Controller at scale: RSS, convergence from cold, warm resync and scale-up latency.

A benchmark, not a test: it starts a real local control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager, kwok) with enough fake GPU nodes, creates N DynamoGraphDeployments that restore
from Ready DynamoCheckpoints (checkpointRef mode), then runs the real controller as a subprocess
(`dynamo-snapshot controller --no-leader-elect --metrics-port P`, through a launcher that registers only
that subcommand) and measures it from outside:

* cold convergence: controller started with every DGD in place and no pod; the clock runs from the
  controller's process start until N*replicas managed pods exist AND every DGD's
  status.observedGeneration == metadata.generation (also reported: until every pod is Running and every
  DGD's status says readyReplicas == replicas, which includes the scheduler's and kwok's work);
* RSS of the controller process (VmRSS / VmHWM from /proc/<pid>/status);
* scale-up latency: the worker's replicas += 1 (`spec.components[0].replicas`, at v1beta1) on randomly
  chosen DGDs, paced, from the patch response to the new pod's ADDED event on the benchmark's own pod
  watch (p50/p95/max), plus a burst;
* warm resync: the controller restarted with everything in place, until its caches are synced and a full
  pass over every DGD has finished (read from its Prometheus metrics), checking it creates nothing.

The benchmark observes through watches (one on managed pods, one on DGDs), never list polling, so its own
load on the 2-core machine stays small; it reports the CPU each component used in each phase.

    .venv/bin/python benchmarks/controller_scale.py --out benchmarks/results/controller-scale.json
    .venv/bin/python benchmarks/controller_scale.py --dgds 50 --out /tmp/smoke.json   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.kube import NAMESPACE, NODE, POD, ApiError, Kube, Obj, ResourceKind
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot.kube.kinds import CHECKPOINT, DGD
from dynamo_snapshot_dev.localcluster import LocalCluster, gpu_node_manifest

REPO = Path(__file__).resolve().parent.parent
SERVICE = "VllmWorker"
MANAGED = f"{protocol.LABEL_MANAGED_BY}={protocol.MANAGED_BY_VALUE}"
IDENTITY = {"model": "Qwen/Qwen3-0.6B", "backendFramework": "vllm", "tensorParallelSize": 1}
GPU_PRODUCT, DRIVER_MAJOR = "NVIDIA-H200", 580
SERVICE_ACCOUNT = ResourceKind("", "v1", "serviceaccounts", "ServiceAccount")
# DGDs are written and watched at the version their CRD stores (v1beta1), read in v1alpha1's shape.
STORED = DgdVersion()
DGD_KIND = "DynamoGraphDeployment"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- manifests
def dgd_manifest(name: str, replicas: int, checkpoint_ref: str, scheduler: str | None = None) -> Obj:
    extra: Obj = {
        "mainContainer": {"image": "vllm-runtime:bench", "command": ["python3", "-m", "dynamo.vllm"]}
    }
    if scheduler:
        extra["schedulerName"] = scheduler
    return {
        "apiVersion": DGD.api_version,  # v1alpha1's shape; written at the version stored (STORED)
        "kind": DGD.kind,
        "metadata": {"name": name},
        "spec": {
            "backendFramework": "vllm",
            "services": {
                SERVICE: {
                    "componentType": "worker",
                    "replicas": replicas,
                    "resources": {"limits": {"gpu": "1"}},
                    "extraPodSpec": extra,
                    "checkpoint": {"enabled": True, "checkpointRef": checkpoint_ref},
                }
            },
        },
    }


def checkpoint_manifest(name: str) -> Obj:
    """A user's pre-warmed checkpoint (no managed-by label: DGDs reference it, they do not own it)."""
    return {
        "apiVersion": CHECKPOINT.api_version,
        "kind": CHECKPOINT.kind,
        "metadata": {
            "name": name,
            "labels": {protocol.LABEL_CHECKPOINT_HASH: compute_identity_hash(IDENTITY)},
        },
        "spec": {
            "identity": IDENTITY,
            "job": {
                "podTemplateSpec": {"spec": {"containers": [{"name": "main", "image": "vllm-runtime:bench"}]}}
            },
        },
    }


def ready_status() -> Obj:
    """What the controller would have written once the node agent reported the checkpoint."""
    return {
        "phase": "Ready",
        "identityHash": compute_identity_hash(IDENTITY),
        "location": f"/var/lib/dynamo-snapshot/artifacts/{compute_identity_hash(IDENTITY)}",
        "storageType": "pvc",
        "message": "pre-warmed for the benchmark",
        "compatibility": {"gpuProduct": GPU_PRODUCT, "cudaDriverMajor": str(DRIVER_MAJOR), "gpuCount": 1},
    }


async def seed_bench_graph(kube: Kube, ns: str, *, nodes: int, gpus: int, pods: int, replicas: int) -> None:
    """Namespace ``ns``, ``nodes`` kwok GPU nodes, a Ready pre-warmed checkpoint and the DGD "bench" of
    ``replicas`` workers restoring from it: the set-up of the failover and crossing benchmarks."""
    await kube.create(NAMESPACE, {"metadata": {"name": ns}})
    for i in range(nodes):
        node = gpu_node_manifest(
            f"kwok-gpu-{i}", product=GPU_PRODUCT, gpus=gpus, driver_major=DRIVER_MAJOR, pods=pods
        )
        await kube.create(NODE, node)
    await kube.create(CHECKPOINT, checkpoint_manifest("prewarmed"), ns)
    await kube.patch_status(CHECKPOINT, "prewarmed", ready_status(), ns)
    await kube.create(STORED.kind, STORED.manifest(dgd_manifest("bench", replicas, "prewarmed")), ns)


async def bench_pods(kube: Kube, ns: str) -> list[Obj]:
    """The DGD "bench"'s worker pods, those being deleted left out."""
    items, _ = await kube.list_all(POD, ns, label_selector=f"{protocol.LABEL_GRAPH}=bench")
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


# ---------------------------------------------------------------------------------------------- processes
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (kB) of a process."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


def _stat(pid: int) -> tuple[str, int, float]:
    """(comm, ppid, cpu seconds) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # after "pid (comm) ": state ppid ... utime is field 14, stime 15 (1-based over the whole line)
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_by_component(controller_pid: int | None) -> dict[str, float]:
    """CPU seconds used so far by each child of this process (the cluster components and the
    controller) and by the benchmark itself."""
    me = os.getpid()
    out: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            comm, ppid, cpu = _stat(pid)
        except (OSError, ValueError, IndexError):
            continue
        if pid == me:
            out["benchmark"] = cpu
        elif ppid == me:
            name = "controller" if pid == controller_pid else comm
            out[name] = out.get(name, 0.0) + cpu
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    out[_BUSY] = (user + nice + system + irq + softirq) / _CLK_TCK
    out[_STEAL] = steal / _CLK_TCK
    return out


_BUSY, _STEAL = "_machine_busy", "_machine_steal"


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds per component between two snapshots, plus what everything else on the machine used
    ("other processes": e.g. a test suite running beside the benchmark) and hypervisor steal."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    busy, steal = delta.pop(_BUSY), delta.pop(_STEAL)
    delta["other processes"] = max(0.0, busy - sum(delta.values()))
    delta["steal"] = steal
    return {k: round(v, 1) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `dynamo-snapshot controller` exactly (controller_cmd's parser and run()), but without importing the other
# subcommands, so a half-written sibling command in the working tree cannot stop the benchmark.
_LAUNCHER = """import argparse, sys
from dynamo_snapshot.cli import controller_cmd
parser = argparse.ArgumentParser(prog="dynamo-snapshot")
controller_cmd.register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args()
sys.exit(args.run(args))
"""


@dataclass
class ControllerProc:
    """The controller as a child process, with its JSON log in a file and its metrics on a port."""

    kubeconfig: Path
    log_path: Path
    workers: int | None
    profile: Path | None = None
    pythonpath: Path | None = None
    metrics_port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    started_mono: float = 0.0
    started_wall: float = 0.0

    def start(self) -> None:
        prof = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        launcher = self.log_path.parent / "dynamo_snapshot_controller.py"
        launcher.write_text(_LAUNCHER)
        argv = [
            sys.executable,
            *prof,
            str(launcher),
            "controller",
            "--kubeconfig",
            str(self.kubeconfig),
            "--no-leader-elect",
            "--metrics-port",
            str(self.metrics_port),
        ]
        if self.workers:
            argv += ["--workers", str(self.workers)]
        handle = self.log_path.open("ab")
        env = dict(os.environ)
        if self.pythonpath:  # --controller-pythonpath: another copy of the package, e.g. before a change
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.pythonpath), env.get("PYTHONPATH")) if p)
        self.started_mono, self.started_wall = time.monotonic(), time.time()
        self.popen = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        handle.close()

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        return self.popen.returncode

    def memory_mib(self) -> dict[str, float]:
        st = proc_status(self.pid)
        return {"rss_mib": round(st["VmRSS"] / 1024, 1), "hwm_mib": round(st["VmHWM"] / 1024, 1)}

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def log_time(self, msg: str) -> float | None:
        """Seconds from process start to the first log line `msg` (of this process run)."""
        for rec in self.log_lines():
            if rec.get("msg") != msg:
                continue
            ts = datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
            if ts >= self.started_wall - 1.0:
                return ts - self.started_wall
        return None

    def metrics(self) -> dict[str, float]:
        """The process's Prometheus metrics as {"name{labels}": value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def metric_summary(m: dict[str, float]) -> dict[str, Any]:
    dgd, ckpt = DGD_KIND, "DynamoCheckpoint"
    return {
        "dgd_reconciles": metric_sum(m, "dynsnap_reconcile_duration_seconds_count", kind=dgd),
        "dgd_reconcile_seconds": round(metric_sum(m, "dynsnap_reconcile_duration_seconds_sum", kind=dgd), 1),
        "dgd_reconcile_errors": metric_sum(m, "dynsnap_reconcile_errors_total", kind=dgd),
        "checkpoint_reconciles": metric_sum(m, "dynsnap_reconcile_duration_seconds_count", kind=ckpt),
        "pods_created": metric_sum(m, "dynsnap_worker_pods_created_total"),
        "events_written": metric_sum(m, "dynsnap_events_total", outcome="written"),
        "events_dropped": metric_sum(m, "dynsnap_events_total", outcome="dropped"),
        "informer_events": metric_sum(m, "dynsnap_informer_events_total"),
        "watch_restarts": metric_sum(m, "dynsnap_informer_watch_restarts_total"),
    }


_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def apiserver_metrics(api: k8s_client.ApiClient) -> dict[str, float]:
    """The apiserver's own /metrics: request counts by verb and resource, watch events by resource."""
    resp = await api.call_api(
        "/metrics",
        "GET",
        header_params={"Accept": "text/plain"},
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=30,
    )
    try:
        text = (await resp.read()).decode()
    finally:
        resp.release()
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(_LABEL.findall(line))
            res = labels.get("resource", "")
            if labels.get("subresource"):
                res += "/" + labels["subresource"]
            out[f"{labels.get('verb')} {res}"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("apiserver_watch_events_total{"):
            labels = dict(_LABEL.findall(line))
            out[f"WATCH-EVENTS {labels.get('resource', '')}"] += float(line.rsplit(" ", 1)[1])
    return dict(out)


def top_requests(after: dict[str, float], before: dict[str, float], n: int = 14) -> dict[str, int]:
    delta = {k: int(v - before.get(k, 0.0)) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in delta.items() if v > 0), key=lambda kv: -kv[1])[:n])


def foreign_control_planes() -> int:
    """kube-apiserver processes on this machine that are not ours (another test run competing for CPU)."""
    me, count = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                comm, ppid, _ = _stat(int(entry))
                count += comm == "kube-apiserver" and ppid != me
    return count


# ---------------------------------------------------------------------------------------------- watching
@dataclass
class Observed:
    """What the benchmark's own watches have seen: managed pods and DGDs."""

    pods: dict[str, str] = field(default_factory=dict)  # "ns/name" -> phase, live (not deleting) pods
    pods_per_graph: Counter[str] = field(default_factory=Counter)  # "ns/graph" -> live pods
    running: int = 0
    pods_added: int = 0
    pod_events: int = 0
    # "ns/name" -> (generation, observedGeneration, readyReplicas); desired replicas kept separately so the
    # benchmark can raise it before it patches (no false "overshoot" while its own watch lags).
    dgds: dict[str, tuple[int, int | None, int]] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)
    dgd_events: int = 0
    last_event: float = field(default_factory=time.monotonic)
    overshoot: dict[str, int] = field(default_factory=dict)  # graphs that ever had more pods than desired
    waiters: defaultdict[str, list[asyncio.Future[float]]] = field(default_factory=lambda: defaultdict(list))

    def on_pod(self, etype: str, pod: Obj, now: float) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        graph = f"{meta['namespace']}/{(meta.get('labels') or {}).get(protocol.LABEL_GRAPH, '')}"
        self.pod_events += 1
        self.last_event = now
        gone = etype == "DELETED" or bool(meta.get("deletionTimestamp"))
        old = self.pods.pop(key, None)
        if old is not None:
            self.pods_per_graph[graph] -= 1
            self.running -= old == "Running"
        if gone:
            return
        phase = str((pod.get("status") or {}).get("phase") or "")
        self.pods[key] = phase
        self.pods_per_graph[graph] += 1
        self.running += phase == "Running"
        if old is None:
            self.pods_added += 1
            for fut in self.waiters.pop(graph, []):
                if not fut.done():
                    fut.set_result(now)
            want = self.desired.get(graph)
            if want is not None and self.pods_per_graph[graph] > want:
                self.overshoot[graph] = max(self.overshoot.get(graph, 0), self.pods_per_graph[graph] - want)

    def on_dgd(self, etype: str, stored: Obj, now: float) -> None:
        dgd = STORED.view(stored)
        meta = dgd["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        self.dgd_events += 1
        self.last_event = now
        if etype == "DELETED":
            self.dgds.pop(key, None)
            return
        status = dgd.get("status") or {}
        svc = (status.get("services") or {}).get(SERVICE) or {}
        self.dgds[key] = (
            int(meta.get("generation") or 0),
            status.get("observedGeneration"),
            svc.get("readyReplicas") or 0,
        )
        replicas = int(dgd["spec"]["services"][SERVICE].get("replicas") or 0)
        self.desired[key] = max(replicas, self.desired.get(key, 0))

    def all_observed(self) -> bool:
        return all(obs == gen for gen, obs, _ in self.dgds.values())

    def all_status_ready(self) -> bool:
        return all(
            obs == gen and ready == self.desired.get(key, -1) for key, (gen, obs, ready) in self.dgds.items()
        )


async def watch_forever(
    kube: Kube,
    kind: ResourceKind,
    resource_version: str,
    on_event: Callable[[str, Obj, float], None],
    label_selector: str | None = None,
) -> None:
    """Watch all namespaces from `resource_version`, resuming where it ended; a 410 is fatal (the
    benchmark would have missed events)."""
    rv = resource_version
    while True:
        try:
            stream = kube.watch(
                kind, None, resource_version=rv, label_selector=label_selector, timeout_seconds=1800
            )
            async with aclosing(stream) as events:
                async for etype, obj in events:
                    rv = str(obj["metadata"].get("resourceVersion") or rv)
                    if etype != "BOOKMARK":
                        on_event(etype, obj, time.monotonic())
        except ApiError as e:
            if e.status == 410:
                raise RuntimeError(f"benchmark watch on {kind} expired; results would be incomplete") from e
            say(f"watch {kind} failed ({e}); resuming")
            await asyncio.sleep(0.2)
        except (OSError, TimeoutError) as e:
            say(f"watch {kind} connection failed ({e!r}); resuming")
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------------- helpers
async def bounded(concurrency: int, calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Await `calls` (coroutines, not started yet) with at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(call: Awaitable[Any]) -> Any:
        async with sem:
            return await call

    return await asyncio.gather(*(one(c) for c in calls))


async def wait_quiet(obs: Observed, quiet: float, limit_s: float) -> float:
    """Wait until neither watch has delivered anything for `quiet` seconds (at most `limit_s`); returns the
    last event's time."""
    for _ in range(int(limit_s / 0.2)):
        if time.monotonic() - obs.last_event >= quiet:
            break
        await asyncio.sleep(0.2)
    return obs.last_event


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (the value at rank ceil(p/100 * n))."""
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_s": round(percentile(values, 50), 4),
        "p95_s": round(percentile(values, 95), 4),
        "p99_s": round(percentile(values, 99), 4),
        "max_s": round(max(values), 4),
        "mean_s": round(statistics.fmean(values), 4),
    }


def since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


# ---------------------------------------------------------------------------------------------- phases
async def make_client(kubeconfig: Path) -> k8s_client.ApiClient:
    cfg = k8s_client.Configuration()
    await k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 128
    return k8s_client.ApiClient(cfg)


async def populate(kube: Kube, args: argparse.Namespace, namespaces: list[str], nodes: int) -> dict[str, Any]:
    t0 = time.monotonic()
    await bounded(16, [kube.create(NAMESPACE, {"metadata": {"name": ns}}) for ns in namespaces])
    node_jobs = [
        kube.create(
            NODE,
            gpu_node_manifest(
                f"kwok-gpu-{i:03d}",
                product=GPU_PRODUCT,
                gpus=args.pods_per_node,
                driver_major=DRIVER_MAJOR,
                pods=args.pods_per_node,
            ),
        )
        for i in range(nodes)
    ]
    await bounded(16, node_jobs)

    async def sa_ready() -> bool:
        for ns in namespaces:
            try:
                await kube.get(SERVICE_ACCOUNT, "default", ns)
            except ApiError:
                return False
        return True

    async def nodes_ready() -> bool:
        items, _ = await kube.list_all(NODE)
        return (
            sum(
                1
                for n in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (n.get("status") or {}).get("conditions") or []
                )
            )
            >= nodes
        )

    for check, what in ((sa_ready, "default service accounts"), (nodes_ready, "kwok nodes Ready")):
        deadline = time.monotonic() + 120
        while not await check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            await asyncio.sleep(0.5)

    ckpt = compute_identity_hash(IDENTITY)
    for ns in namespaces:
        await kube.create(CHECKPOINT, checkpoint_manifest(ckpt), ns)
        await kube.patch_status(CHECKPOINT, ckpt, ready_status(), ns)
    t_setup = time.monotonic()

    # --unscheduled: no scheduler binds the pods, so neither it nor kwok competes for the CPU.
    scheduler = "benchmark-no-scheduler" if args.unscheduled else None
    per_ns = math.ceil(args.dgds / len(namespaces))
    names = [(namespaces[i // per_ns], f"graph-{i:05d}") for i in range(args.dgds)]
    await bounded(
        args.create_concurrency,
        [
            kube.create(STORED.kind, STORED.manifest(dgd_manifest(n, args.replicas, ckpt, scheduler)), ns)
            for ns, n in names
        ],
    )
    t_dgds = time.monotonic()
    return {
        "setup_s": round(t_setup - t0, 1),
        "dgd_create_s": round(t_dgds - t_setup, 1),
        "dgd_create_per_s": round(args.dgds / max(t_dgds - t_setup, 1e-9), 1),
    }


async def scale_latency(
    kube: Kube, obs: Observed, targets: list[str], rate: float | None, limit_s: float
) -> dict[str, Any]:
    """+1 replica on each target; `rate` patches per second, or all at once (bounded) when None."""
    from_response: list[float] = []
    from_request: list[float] = []
    missed: list[str] = []

    async def one(key: str, delay: float) -> None:
        await asyncio.sleep(delay)
        ns, name = key.split("/", 1)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        obs.waiters[key].append(fut)
        want = obs.desired[key] + 1
        obs.desired[key] = want
        sent = time.monotonic()
        # The graph's one component, at the version stored: one write, as a merge patch of v1alpha1 was.
        replicas = [{"op": "replace", "path": "/spec/components/0/replicas", "value": want}]
        await kube.json_patch(STORED.kind, name, replicas, ns)
        answered = time.monotonic()
        try:
            seen = await asyncio.wait_for(asyncio.shield(fut), limit_s)
        except TimeoutError:
            missed.append(key)
            return
        from_response.append(max(0.0, seen - answered))
        from_request.append(seen - sent)

    started = time.monotonic()
    if rate:
        await asyncio.gather(*(one(k, i / rate) for i, k in enumerate(targets)))
    else:
        await asyncio.gather(*(one(k, 0.0) for k in targets))
    return {
        "targets": len(targets),
        "rate_per_s": rate,
        "wall_s": round(time.monotonic() - started, 2),
        "from_patch_response": latency_stats(from_response),
        "from_patch_request": latency_stats(from_request),
        "missed": len(missed),
    }


async def bench(cluster: LocalCluster, args: argparse.Namespace, nodes: int, workdir: Path) -> dict[str, Any]:
    api = await make_client(cluster.kubeconfig)
    kube = Kube(api, field_manager="benchmark")
    ctrl: ControllerProc | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        namespaces = [f"bench-{i:02d}" for i in range(args.namespaces)]
        say(f"creating {len(namespaces)} namespaces, {nodes} kwok nodes, {args.dgds} DGDs x {args.replicas}")
        setup = await populate(kube, args, namespaces, nodes)
        say(f"setup done: {setup}")

        obs = Observed()
        dgd_items, dgd_rv = await kube.list_all(STORED.kind)
        for d in dgd_items:
            obs.on_dgd("ADDED", d, time.monotonic())
        pod_items, pod_rv = await kube.list_all(POD, label_selector=MANAGED)
        assert not pod_items, "managed pods exist before the controller started"
        tasks.append(asyncio.create_task(watch_forever(kube, STORED.kind, dgd_rv, obs.on_dgd)))
        tasks.append(asyncio.create_task(watch_forever(kube, POD, pod_rv, obs.on_pod, MANAGED)))
        expected = args.dgds * args.replicas

        # ---------------------------------------------------------------- cold convergence
        await asyncio.sleep(2)
        probe_before = speed_probe()
        foreign: list[int] = []

        async def sample_foreign() -> None:
            while True:
                foreign.append(foreign_control_planes())
                await asyncio.sleep(2)

        tasks.append(asyncio.create_task(sample_foreign()))
        load_before = os.getloadavg()
        am0 = await apiserver_metrics(api)
        cpu0 = cpu_by_component(None)
        ctrl = ControllerProc(
            cluster.kubeconfig,
            workdir / "controller-cold.log",
            args.workers,
            args.profile_controller,
            args.controller_pythonpath,
        )
        ctrl.start()
        t0 = ctrl.started_mono
        say(f"controller started (pid {ctrl.pid}); waiting for {expected} pods and observedGeneration")
        peak_rss = 0.0

        def sample_rss() -> None:
            nonlocal peak_rss
            if ctrl is not None and ctrl.alive():
                peak_rss = max(peak_rss, ctrl.memory_mib()["rss_mib"])

        marks: dict[str, float | None] = {}
        checks: dict[str, Callable[[], bool]] = {
            "first_pod": lambda: obs.pods_added > 0,
            "all_pods_exist": lambda: len(obs.pods) >= expected,
            "all_observed": obs.all_observed,
            "converged": lambda: len(obs.pods) >= expected and obs.all_observed(),
        }
        if not args.unscheduled:
            checks["all_running"] = lambda: obs.running >= expected
            checks["all_status_ready"] = lambda: len(obs.pods) >= expected and obs.all_status_ready()
        deadline = t0 + args.converge_timeout
        last_report = t0
        while time.monotonic() < deadline and len(marks) < len(checks):
            if not ctrl.alive():
                raise RuntimeError(f"controller exited with {ctrl.popen.returncode if ctrl.popen else '?'}")
            now = time.monotonic()
            for name, check in checks.items():
                if name not in marks and check():
                    marks[name] = now
                    say(f"  {name} at {now - t0:.1f}s")
            sample_rss()
            if now - last_report > 10:
                last_report = now
                say(
                    f"  t={now - t0:.0f}s pods={len(obs.pods)} running={obs.running} "
                    f"observed={sum(1 for g, o, _ in obs.dgds.values() if g == o)}/{len(obs.dgds)} "
                    f"rss={peak_rss:.0f}MiB"
                )
            await asyncio.sleep(0.05)
        t_last = await wait_quiet(obs, args.quiet, 120)
        cpu1 = cpu_by_component(ctrl.pid)
        am1 = await apiserver_metrics(api)
        synced = ctrl.log_time("caches synced")
        m_cold = ctrl.metrics()
        # Steady RSS: sampled over a few quiet seconds after convergence.
        steady = []
        for _ in range(5):
            steady.append(ctrl.memory_mib())
            await asyncio.sleep(1)
        cold = {
            "controller_start_to": {name: since(marks.get(name), t0) for name in checks},
            "caches_synced_s": round(synced, 2) if synced is not None else None,
            "last_event_s": round(t_last - t0, 2),
            "pods_seen": len(obs.pods),
            "pods_added": obs.pods_added,
            "graphs_over_desired": len(obs.overshoot),
            "controller_metrics": metric_summary(m_cold),
            "cpu_s": cpu_delta(cpu1, cpu0),
            "apiserver_requests": top_requests(am1, am0),
            "loadavg_before": [round(x, 2) for x in load_before],
            "wall_s": round(time.monotonic() - t0, 1),
        }
        cold_steady = steady[-1]
        say(f"cold: {cold['controller_start_to']}, steady memory {cold_steady}")

        # ---------------------------------------------------------------- scale-up latency
        rng = random.Random(args.seed)
        keys = sorted(obs.dgds)
        picked = rng.sample(keys, min(len(keys), args.scale_samples + args.burst))
        paced_keys, burst_keys = picked[: args.scale_samples], picked[args.scale_samples :]
        cpu2 = cpu_by_component(ctrl.pid)
        say(f"scale: +1 replica on {len(paced_keys)} DGDs at {args.scale_rate}/s")
        paced = await scale_latency(kube, obs, paced_keys, args.scale_rate, limit_s=60)
        say(f"  paced: {paced['from_patch_response']}")
        await wait_quiet(obs, args.quiet, 120)
        burst: dict[str, Any] | None = None
        if burst_keys:
            say(f"scale burst: +1 replica on {len(burst_keys)} DGDs at once")
            burst = await scale_latency(kube, obs, burst_keys, None, limit_s=120)
            say(f"  burst: {burst['from_patch_response']}")
            await wait_quiet(obs, args.quiet, 120)
        cpu3 = cpu_by_component(ctrl.pid)
        am2 = await apiserver_metrics(api)
        sample_rss()
        after_scale = ctrl.memory_mib()
        m_scale = ctrl.metrics()
        scale_overshoot = len(obs.overshoot)

        # ---------------------------------------------------------------- warm resync
        say("warm resync: restarting the controller with everything in place")
        code = ctrl.stop()
        cold_hwm = max(peak_rss, after_scale["hwm_mib"])
        await asyncio.sleep(2)
        pods_before, dgd_events_before = obs.pods_added, obs.dgd_events
        cpu4 = cpu_by_component(None)
        warm = ControllerProc(
            cluster.kubeconfig,
            workdir / "controller-warm.log",
            args.workers,
            pythonpath=args.controller_pythonpath,
        )
        warm.start()
        ctrl = warm
        w0 = warm.started_mono
        n_dgds = len(obs.dgds)
        warm_peak = 0.0
        t_pass: float | None = None
        m_warm: dict[str, float] = {}
        while time.monotonic() < w0 + args.converge_timeout:
            if not warm.alive():
                raise RuntimeError("warm controller exited")
            warm_peak = max(warm_peak, warm.memory_mib()["rss_mib"])
            with contextlib.suppress(OSError):
                m_warm = warm.metrics()
                done = metric_sum(m_warm, "dynsnap_reconcile_duration_seconds_count", kind=DGD_KIND)
                depth = metric_sum(m_warm, "dynsnap_workqueue_depth")
                inflight = metric_sum(m_warm, "dynsnap_workqueue_inflight")
                if done >= n_dgds and depth == 0 and inflight == 0:
                    t_pass = time.monotonic()
                    break
            await asyncio.sleep(0.1)
        warm_synced = warm.log_time("caches synced")
        await asyncio.sleep(args.quiet)
        cpu5 = cpu_by_component(warm.pid)
        warm_mem = warm.memory_mib()
        m_warm = warm.metrics()
        warm_res = {
            "caches_synced_s": round(warm_synced, 2) if warm_synced is not None else None,
            "full_pass_done_s": since(t_pass, w0),
            "pass_after_sync_s": round(t_pass - w0 - warm_synced, 2)
            if t_pass is not None and warm_synced is not None
            else None,
            "pods_created": obs.pods_added - pods_before,
            "dgd_writes_seen": obs.dgd_events - dgd_events_before,
            "controller_metrics": metric_summary(m_warm),
            "memory_mib": {**warm_mem, "peak_sampled_rss_mib": warm_peak},
            "cpu_s": cpu_delta(cpu5, cpu4),
        }
        say(f"warm: {warm_res}")
        warm.stop()
        ctrl = None

        rss_mib = max(s["rss_mib"] for s in [*steady, after_scale])
        return {
            "dgds": args.dgds,
            "pods": expected,
            "rss_mib": rss_mib,
            "resync_s": since(marks.get("converged"), t0),
            "scale_p50_s": paced["from_patch_response"].get("p50_s"),
            "scale_p95_s": paced["from_patch_response"].get("p95_s"),
            "details": {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "machine": machine(),
                "cluster": {
                    "namespaces": len(namespaces),
                    "kwok_nodes": nodes,
                    "pods_per_node": args.pods_per_node,
                    "replicas_per_dgd": args.replicas,
                    "controller_workers": args.workers or "default",
                    **setup,
                },
                "memory_mib": {
                    "steady_after_converge": cold_steady,
                    "after_scale": after_scale,
                    "peak_hwm_cold_process": cold_hwm,
                    "warm_process": warm_res["memory_mib"],
                },
                "cold_converge": cold,
                "scale_paced": paced,
                "scale_burst": burst,
                "scale_graphs_over_desired": scale_overshoot,
                "scale_cpu_s": cpu_delta(cpu3, cpu2),
                "scale_apiserver_requests": top_requests(am2, am1),
                "scale_controller_metrics": metric_summary(m_scale),
                "warm_resync": warm_res,
                "cold_controller_exit_code": code,
                "speed_probe_s": {"before": probe_before, "after": speed_probe()},
                "unscheduled": args.unscheduled,
                "controller_profiled": bool(args.profile_controller),
                "controller_pythonpath": str(args.controller_pythonpath or ""),
                # Other control planes running here (e.g. a test suite) compete for the 2 cores: how many
                # of the 2-second samples saw one.
                "foreign_control_plane_samples": f"{sum(1 for n in foreign if n)}/{len(foreign)}",
            },
        }
    finally:
        if ctrl is not None:
            ctrl.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.close()


def speed_probe() -> float:
    """Seconds for a fixed single-threaded Python workload (JSON round trips of a pod-sized object).

    The 2 vCPUs here are shared with other tenants; runs of identical work have differed by a third in
    CPU time. Recording this next to the results tells a slow machine apart from a slow controller.
    """
    env = [{"name": f"E{i}", "value": "v" * 30} for i in range(30)]
    pod: Obj = {
        "metadata": {"name": "x" * 20, "labels": {f"k{i}": "v" * 20 for i in range(12)}},
        "spec": {"containers": [{"name": "main", "env": env}]},
    }
    raw = json.dumps(pod)
    started = time.perf_counter()
    for _ in range(20_000):
        json.dumps(json.loads(raw))
    return round(time.perf_counter() - started, 3)


def machine() -> dict[str, Any]:
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dgds", type=int, default=1000, help="DynamoGraphDeployments (default 1000)")
    p.add_argument("--replicas", type=int, default=10, help="worker replicas per DGD (default 10)")
    p.add_argument("--namespaces", type=int, default=10, help="namespaces the DGDs are spread over (10)")
    p.add_argument("--nodes", type=int, default=0, help="kwok GPU nodes (default: enough for every pod)")
    p.add_argument("--pods-per-node", type=int, default=130, help="pods and GPUs per kwok node (130)")
    p.add_argument("--workers", type=int, default=None, help="controller --workers (default: its own)")
    p.add_argument("--scale-samples", type=int, default=200, help="DGDs scaled +1, paced (200)")
    p.add_argument("--scale-rate", type=float, default=20.0, help="paced scale-ups per second (20)")
    p.add_argument("--burst", type=int, default=200, help="other DGDs scaled +1 at once; 0: none (200)")
    p.add_argument("--create-concurrency", type=int, default=32, help="parallel DGD creates (32)")
    p.add_argument("--converge-timeout", type=float, default=900.0, help="seconds (900)")
    p.add_argument("--quiet", type=float, default=5.0, help="seconds without events that count as settled")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument(
        "--unscheduled",
        action="store_true",
        help="diagnostic: pods name a scheduler that does not exist, so they stay Pending and only the "
        "controller and the apiserver work (no scheduler, no kwok)",
    )
    p.add_argument(
        "--controller-pythonpath",
        type=Path,
        help="diagnostic: run the controller from another copy of dynamo_snapshot (put first on its "
        "PYTHONPATH), e.g. `git archive HEAD dynamo_snapshot | tar -x -C DIR` for before/after numbers",
    )
    p.add_argument(
        "--profile-controller",
        type=Path,
        help="diagnostic: run the cold controller under cProfile, writing this file (slows it down)",
    )
    p.add_argument("--workdir", type=Path, help="cluster + controller logs (default: a temporary directory)")
    p.add_argument("--out", type=Path, help="write the results JSON here")
    args = p.parse_args(argv)
    args.namespaces = max(1, min(args.namespaces, args.dgds))
    args.scale_samples = min(args.scale_samples, args.dgds)
    args.burst = min(args.burst, args.dgds - args.scale_samples)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    total = args.dgds * args.replicas + args.scale_samples + args.burst
    nodes = args.nodes or math.ceil(total * 1.1 / args.pods_per_node)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="controller-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"workdir {workdir}")
    cluster = LocalCluster(workdir / "cluster")
    try:
        t = time.monotonic()
        cluster.start(progress=say)
        cluster.install_crds()
        say(f"control plane + CRDs up in {time.monotonic() - t:.1f}s")
        result = asyncio.run(bench(cluster, args, nodes, workdir))
    finally:
        say("stopping the control plane")
        cluster.stop()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        say(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
