"""This project's agent vs NVIDIA's snapshot (github.com/ai-dynamo/snapshot: its operator and agent), on the
same real kubelet node, capturing and restoring the same workers (benchmarks/peer_workloads.py): the CPU
reference worker and a Dynamo 1.6 worker with Dynamo's mocker engine; one image, one environment each, no
memory limit.

In one invocation: NVIDIA's operator and agent on a fresh local cluster with the real node (their CRDs only,
not ours), which is then torn down; then this project's controller and agent in-process on another fresh
cluster (as benchmarks/kubelet_restore.py). For each workload in turn, each side runs the source pod until it
is Ready (its worker wrote ready-for-snapshot), creates a PodSnapshot of it, timed from the create call to the
PodSnapshot's Ready condition (50 ms polls), then restores it ``--restores`` times, one pod at a time, each
timed from the create call to the first ``GET /health`` 200 on the pod's IP (10 ms polls from the host; the
Dynamo worker's is its system server's, 200 once its generate endpoint is registered). Written: per side and
workload its checkpoint times (PodSnapshot created -> Ready, the agent's own), the artifact's bytes, restore
p50/p95/min/max and samples, CPU seconds, failures; and the ratios ours/theirs.

    scripts/nvidia-snapshot-peer.sh DIR   # DIR: a checkout of ai-dynamo/snapshot ($NVIDIA_SNAPSHOT_COMMIT)
    flock /tmp/dsnap-realnode.lock python benchmarks/vs_nvidia_snapshot.py --nv-source DIR \
        --out benchmarks/results/vs-nvidia-snapshot.json      # root; about 5 min

Our side's restore pods name the PodSnapshot in `nvidia.com/restore-from` and are shaped as this project's
restore webhook shapes them (control volume, standby env); the webhook itself is not run, as NVIDIA's side
has none.

NVIDIA's side (facts from reading their source at b7e707c and running it here):
- CPU-only works with plain CRIU: the agent probes each PID with cuda-checkpoint-helper and silently skips
  CUDA when that fails; no driver, helper or CUDA plugin is needed. Their agent, nsrestore (Go, static) and
  ns-bind-mount (C) are built by scripts/nvidia-snapshot-peer.sh; CRIU is this project's 4.1.1 build, in
  their agent image at /usr/local/sbin/criu and in the restore bundle /snapshot-binaries (with its library
  closure less the libc family, as their Dockerfile; criu-plugins/ empty).
- Chart values stock CRIU 4.1.1 needs: allowUprobes false (unknown option: the dump fails with err:56),
  imageIoMode writeback (the RPC field is ignored anyway), tcpEstablished false (its inet-remap plugin needs
  a CRIU hook newer than any CRIU source here), libDir "".
- The agent has no kubeconfig flag (in-cluster only) and fixed paths (/checkpoints, /etc/snapshot,
  /host/proc, /snapshot-binaries), so it runs as their DaemonSet's pod: privileged, hostPID/IPC/Network,
  the real node's containerd socket dir and root, a hostPath for /checkpoints (their RWX PVC), the apiserver
  at 127.0.0.1; no runtimeClassName nvidia, GPU nodeSelector or seccomp init container.
- This host is a cgroup v1 + v2 hybrid: the agent takes the `0::` path and asks CRIU to freeze
  /sys/fs/cgroup/<it>, so /sys/fs/cgroup in the agent pod is the host's v1 freezer hierarchy (with the
  chart's mount the dump fails: "Neither a cgroupv1 (freezer.state) or cgroupv2 (cgroup.freeze) control
  file found"). Their image has iptables-restore, which CRIU's network lock needs ("Locking network
  failed"); ours adds the host's xtables-nft-multi.
- The workload image needs /run (CRIU's restore mounts a tmpfs there for the xtables lock) and gzip (it
  unpacks the container's /dev tmpfs with `tar --gzip`); their placeholders are distribution images, the
  project's worker image is minimal, so both agents here restore node.worker_image plus /run and
  /bin/gzip. On these failures their agent reports go-criu's first `Error` line (a harmless RLIMIT_NOFILE
  one); the cause is in the dump/restore log tail it logs.
- Checkpoint: a PodSnapshot; their operator (its manager, installed from their chart: nvidia_operator.py
  says what that needed here) creates the cluster-scoped PodSnapshotContent labelled with the node, the
  agent captures and sets it Ready, the operator mirrors Ready onto the PodSnapshot. Their manager at
  b7e707c does not run the SnapshotJob controller, so no SnapshotJob is used. `--nv-without-operator`
  writes that PodSnapshotContent instead (nvidia_peer.checkpoint). Source pod: their labels
  (checkpoint-id, is-checkpoint-source), the snapshot-control emptyDir (subPath main) and a readiness probe
  on ready-for-snapshot. Restore pods: NewRestorePod's labels, target-containers and artifact-version
  annotations, standby env and a startup probe on restore-complete; their agent restores them with no
  operator action.
- Not covered: inet-remap, established TCP across an IP change, O_DIRECT images, CUDA, a cgroup v2-only
  host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubernetes_asyncio import client, config  # noqa: E402

from benchmarks.nvidia_operator import (  # noqa: E402
    checkpoint_by_operator,
    install_operator,
    operator_image,
    operator_logs,
)
from benchmarks.nvidia_peer import (  # noqa: E402
    Api,
    Peer,
    Workload,
    agent_image,
    agent_logs,
    checkpoint,
    cond,
    cpu_seconds,
    get_json,
    host_pid,
    install,
    log,
    restores,
    serving,
    start_agent,
    start_cluster,
    wait,
    worker_pod,
    workload_image,
)
from benchmarks.peer_workloads import cpu_worker, dynamo_mocker, dynamo_site  # noqa: E402
from dynamo_snapshot.agent.timings import AWAIT_CONTAINER_PHASE  # noqa: E402
from dynamo_snapshot.api import protocol  # noqa: E402
from dynamo_snapshot.artifact import MANIFEST_NAME  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402
from dynamo_snapshot.kube import POD, Kube  # noqa: E402
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT  # noqa: E402
from dynamo_snapshot_dev.localcluster import LocalCluster  # noqa: E402
from tests.helpers.kubelet_stack import Stack, eventually, ready, snapshot_pod  # noqa: E402

NAMESPACE = "vs-nvidia"


def rusage() -> float:
    """CPU seconds of this process and its reaped children (CRIU runs as one)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def ours_pod(s: Stack, name: str, work: Workload, *, restore: bool) -> dict[str, Any]:
    """The source pod (readiness on ready-for-snapshot, as theirs) or a restore pod: `restore-from` the
    PodSnapshot, shaped as this project's restore webhook shapes it (control volume, standby env); the
    webhook itself is not in the path (nor its readiness gate), as their side has no webhook."""
    main: dict[str, Any] = {"image": work.image.name, **work.main}
    if not restore:
        probe = ["cat", f"{protocol.CONTROL_MOUNT_PATH}/ready-for-snapshot"]
        main["readinessProbe"] = {"exec": {"command": probe}, "periodSeconds": 1, "timeoutSeconds": 1}
    pod = snapshot_pod(s.node, name, main, standby=restore, restartPolicy="Never", **work.spec)
    container = pod["spec"]["containers"][0]
    container["env"] += [{"name": k, "value": v} for k, v in work.env.items()]
    container["volumeMounts"] += work.main.get("volumeMounts", [])
    pod["spec"]["volumes"] += work.volumes
    pod["metadata"]["namespace"] = s.namespace
    if restore:
        pod["metadata"]["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: work.ckpt_id}
    return pod


async def checkpoint_ours(s: Stack, work: Workload) -> dict[str, Any]:
    """The source pod once Ready, then a PodSnapshot of it timed from its create call to its Ready
    condition (50 ms polls): this project's controller binds the PodSnapshotContent, its agent captures."""
    source = ours_pod(s, work.source, work, restore=False)
    await s.kube.create(POD, source)

    async def source_ready() -> bool:
        return ready(await s.kube.get(POD, work.source, s.namespace))

    await eventually(source_ready, 180, f"the source pod {work.source} to be Ready")
    body = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": work.ckpt_id, "namespace": s.namespace},
        "spec": {"source": {"podRef": {"name": work.source, "containers": ["main"]}}},
    }
    t0 = time.monotonic()
    await s.kube.create(POD_SNAPSHOT, body)
    while True:
        snap = await s.kube.get(POD_SNAPSHOT, work.ckpt_id, s.namespace)
        if cond(snap, "Failed"):
            raise RuntimeError(f"checkpoint failed: {snap['status']}")
        if cond(snap, "Ready"):
            break
        await asyncio.sleep(0.05)
    wall = time.monotonic() - t0
    root = s.store / s.namespace / snap["metadata"]["uid"]  # the agent's artifact key of this PodSnapshot
    manifests = sorted(root.rglob(MANIFEST_NAME))
    timings = json.loads(manifests[0].read_text()).get("timings") or {} if manifests else {}
    return {
        "path": "PodSnapshot -> this project's controller -> PodSnapshotContent -> its agent",
        "agent_s": round(sum(timings.values()), 4) if timings else None,
        "agent_phases_s": timings,
        "podsnapshot_created_to_ready_s": round(wall, 3),
        "status": snap.get("status"),
        "artifact_bytes": sum(
            p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()
        ),
        "artifact_files": sorted(str(p.relative_to(s.store)) for p in root.rglob("*") if p.is_file()),
        "source_container": source["spec"]["containers"][0],
    }


async def restore_ours(s: Stack, name: str, work: Workload) -> Any:
    """One restore pod of the PodSnapshot, timed create -> GET /health 200 on its IP (10 ms polls)."""
    pod = ours_pod(s, name, work, restore=True)
    t0 = time.monotonic()
    await s.kube.create(POD, pod)
    while True:
        got = await s.kube.get(POD, name, s.namespace)
        ann = got["metadata"].get("annotations") or {}
        if ann.get(protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")) == "failed":
            raise RuntimeError(f"{name}: {ann}")
        ip = (got.get("status") or {}).get("podIP") or ""
        if ip and await asyncio.to_thread(serving, ip, work.port):
            break
        await asyncio.sleep(0.01)
    total = time.monotonic() - t0
    got = await s.kube.get(POD, name, s.namespace)
    phases = json.loads(got["metadata"]["annotations"].get(protocol.ANNOTATION_RESTORE_TIMINGS) or "{}")
    own = {k: v for k, v in phases.items() if k != AWAIT_CONTAINER_PHASE}
    sample = {
        "pod": name,
        "total_s": total,
        "agent_restore_s": round(sum(own.values()), 4),
        "agent_phases_s": phases,
        "health": await asyncio.to_thread(get_json, ip, "/health", None, work.port),
        "container": pod["spec"]["containers"][0],
    }
    if work.prompt is not None:
        sample["generate"] = await asyncio.to_thread(get_json, ip, "/generate", work.prompt, work.port)
    return sample


async def measure_ours(s: Stack, work: Workload, n: int) -> dict[str, Any]:
    cpu0 = rusage()
    record = await checkpoint_ours(s, work)
    cpu1 = rusage()
    log(f"ours {work.name} checkpoint: {record['agent_s']}s, {record['artifact_bytes']} B")
    samples: list[dict[str, Any]] = []
    for i in range(n):
        name = f"{work.name}-restore-{i}"
        try:
            sample = await restore_ours(s, name, work)
            log(f"ours {work.name} restore {i}: serving after {sample['total_s']:.3f}s")
        except Exception as e:
            sample = {"pod": name, "error": str(e)[:4000]}
            log(f"ours {work.name} restore {i} FAILED: {e}")
        await s.delete_pod(name)
        samples.append(sample)
    cpu2 = rusage()
    restore_container = next((x.pop("container") for x in samples if "container" in x), None)
    for x in samples:
        x.pop("container", None)
    what = "this process (controller, agent, the 10 ms poller, in-process) and its reaped children (criu)"
    cpu = {"what": what, "checkpoint": round(cpu1 - cpu0, 2), "restores": round(cpu2 - cpu1, 2)}
    return {
        "checkpoint": record,
        "restore_container": restore_container,
        "samples": samples,
        "agent_cpu_s": cpu,
    }


async def run_ours(works: list[Workload], workdir: Path, n: int) -> dict[str, Any]:
    """This project's controller and agent (runtime containerd) on a fresh cluster with the real node: each
    workload in turn."""
    shutil.rmtree(workdir, ignore_errors=True)
    lc = LocalCluster(workdir / "cluster")
    lc.start()
    try:
        lc.install_crds()
        node = lc.start_real_node()
        node.ctr("images", "import", str(works[0].archive), timeout=300)
        lc.kubectl("create", "namespace", NAMESPACE)
        cfg = client.Configuration()
        await config.load_kube_config(config_file=str(lc.kubeconfig), client_configuration=cfg)
        async with client.ApiClient(cfg) as api:
            criu = Criu()
            kube = Kube(api, field_manager="vs-nvidia")
            s = Stack(kube, NAMESPACE, node, criu, workdir / "state", workdir / "store")
            s.start_controller()
            s.start_agent()
            result: dict[str, Any] = {"agent": "dynamo-snapshot (this repository)", "workloads": {}}
            try:
                for work in works:
                    try:
                        result["workloads"][work.name] = await measure_ours(s, work, n)
                    except Exception as e:
                        result["workloads"][work.name] = failed(e)
                        log(f"ours {work.name} FAILED: {e}")
            finally:
                await s.close()
            result["criu"] = str(await criu.version())
            return result
    finally:
        lc.stop_real_node()
        lc.stop()


def failed(e: BaseException) -> dict[str, Any]:
    return {"error": str(e)[:8000], "traceback": traceback.format_exc()[-4000:]}


def measure_nvidia(
    cluster: LocalCluster, api: Api, work: Workload, pids: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    """One workload with their agent (and operator): the source pod once Ready, its PodSnapshot, restores."""
    node = cluster.real_node
    assert node is not None
    checkpoints = args.nv_checkpoints
    source = worker_pod(node, work.source, work, restore=False)
    api.create(source)
    wait(f"source {work.source} Ready", lambda: cond(api.pod(work.source), "Ready"), 180)
    cpu0 = {k: sum(cpu_seconds(pid).values()) for k, pid in pids.items()}
    if "operator" in pids:
        ck = checkpoint_by_operator(cluster, api, work, checkpoints, args.checkpoint_timeout)
    else:
        ck = checkpoint(cluster, api, work, checkpoints, args.checkpoint_timeout)
    ck["source_container"] = source["spec"]["containers"][0]
    cpu1 = {k: sum(cpu_seconds(pid).values()) for k, pid in pids.items()}
    log(f"nvidia {work.name} checkpoint: {ck['agent_s']}s, {ck['artifact_bytes']} B")
    samples = restores(cluster, api, work, args.restores, args.restore_timeout)
    cpu2 = {k: sum(cpu_seconds(pid).values()) for k, pid in pids.items()}
    parts = " and the operator's manager process" if "operator" in pids else ""
    cpu = {
        "what": f"the agent process{parts} (utime+stime) and their reaped children (criu swrk, nsenter, "
        "nsrestore)",
        "checkpoint": round(sum(cpu1.values()) - sum(cpu0.values()), 2),
        "restores": round(sum(cpu2.values()) - sum(cpu1.values()), 2),
        "by_process": {
            k: {"checkpoint": round(cpu1[k] - cpu0[k], 2), "restores": round(cpu2[k] - cpu1[k], 2)}
            for k in pids
        },
    }
    restore_container = worker_pod(node, "r", work, restore=True)["spec"]["containers"][0]
    return {"checkpoint": ck, "restore_container": restore_container, "samples": samples, "agent_cpu_s": cpu}


def run_nvidia(peer: Peer, works: list[Workload], workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Their operator (from their chart) and agent on a fresh cluster with the real node: for each workload a
    PodSnapshot, then restores; the cluster is torn down before this returns. With ``--nv-without-operator``
    the PodSnapshotContent their operator would create is written instead (nvidia_peer.checkpoint)."""
    result: dict[str, Any] = {"agent": f"ai-dynamo/snapshot {peer.commit()}", "criu": str(peer.criu)}
    image, archive = agent_image(peer, workdir / "images")
    result["agent_image"] = {"name": image.name, "archive_bytes": archive.stat().st_size}
    archives = [archive, works[0].archive]
    with_operator = not args.nv_without_operator
    if with_operator:
        op_image, op_archive = operator_image(peer, workdir / "images")
        archives.append(op_archive)
    args.nv_checkpoints = workdir / "checkpoints"
    shutil.rmtree(args.nv_checkpoints, ignore_errors=True)
    args.nv_checkpoints.mkdir(parents=True)
    cluster = start_cluster(workdir / "cluster")
    try:
        result["agent_config"] = install(cluster, peer, workdir, archives)
        api = Api(cluster)
        if with_operator:
            result["operator"] = install_operator(cluster, api, peer, workdir, op_image)
        pids = {"agent": start_agent(cluster, api, image.name, args.nv_checkpoints)}
        if with_operator:
            pids["operator"] = wait("operator process", lambda: host_pid(b"/manager"), 30)
        result["workloads"] = {}
        for work in works:
            try:
                result["workloads"][work.name] = measure_nvidia(cluster, api, work, pids, args)
            except Exception as e:
                result["workloads"][work.name] = failed(e)
                log(f"nvidia {work.name} FAILED: {e}")
        (workdir / "nvidia-agent.log").write_text(agent_logs(cluster))
        if with_operator:
            (workdir / "nvidia-operator.log").write_text(operator_logs(cluster, tail=100000))
    finally:
        cluster.stop()
    return result


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(side: dict[str, Any]) -> dict[str, Any]:
    """The restore samples' statistics (create -> /health 200) and the failures."""
    samples = side.get("samples") or []
    ok = [x["total_s"] for x in samples if "total_s" in x]
    out: dict[str, Any] = {"n": len(samples), "ok": len(ok), "failures": [x for x in samples if "error" in x]}
    if ok:
        out |= {"p50_s": statistics.median(ok), "p95_s": pct(ok, 0.95), "min_s": min(ok), "max_s": max(ok)}
        out["samples_s"] = [round(v, 4) for v in ok]
    own = [x["agent_restore_s"] for x in samples if "agent_restore_s" in x]
    if own:
        out["agent_restore_p50_s"] = statistics.median(own)
    return out


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    def get(side: dict[str, Any], path: str) -> Any:
        for key in path.split("."):
            side = side.get(key) if isinstance(side, dict) else None  # type: ignore[assignment]
        return side

    paths = [f"restore.{k}" for k in ("p50_s", "p95_s", "min_s", "max_s", "agent_restore_p50_s")]
    paths += [
        "checkpoint.agent_s",
        "checkpoint.podsnapshot_created_to_ready_s",
        "checkpoint.artifact_bytes",
        "agent_cpu_s.checkpoint",
        "agent_cpu_s.restores",
    ]
    out: dict[str, float | None] = {}
    for path in paths:
        a, b = get(ours, path), get(theirs, path)
        out[path] = (
            round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None
        )
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--nv-source", type=Path, required=True, help="a checkout of ai-dynamo/snapshot")
    ap.add_argument("--nv-bin", type=Path, default=Path.home() / ".cache/nvidia-snapshot-peer/bin")
    ap.add_argument("--restores", type=int, default=10)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vs-nvidia-snapshot.json")
    ap.add_argument("--workdir", type=Path, help="kept afterwards (default: a temporary directory)")
    ap.add_argument("--workloads", default="cpu-worker,dynamo-mocker", help="comma-separated, in this order")
    ap.add_argument("--checkpoint-timeout", type=float, default=180)
    ap.add_argument("--restore-timeout", type=float, default=120)
    ap.add_argument(
        "--nv-without-operator",
        action="store_true",
        help="write the PodSnapshotContent their operator would create instead of running it",
    )
    ap.add_argument("--skip-ours", action="store_true", help="NVIDIA's agent only (not a comparison)")
    return ap.parse_args()


def tool(name: str) -> Path:
    return Path(shutil.which(name) or f"<{name} not on PATH>")


def workloads(names: list[str], root: Path) -> tuple[list[Workload], dict[str, Any]]:
    """The workloads named (one image), and what each is, for the result."""
    image, archive = workload_image(root / "images")
    works: list[Workload] = []
    for name in names:
        if name == "cpu-worker":
            works.append(cpu_worker(image, archive))
        elif name == "dynamo-mocker":
            site = dynamo_site()
            if site is None:
                raise SystemExit(
                    "vs_nvidia_snapshot: Dynamo's wheels are not installed (scripts/dynamo-wheels.sh)"
                )
            works.append(dynamo_mocker(image, archive, root / "dynamo", site))
        else:
            raise SystemExit(f"vs_nvidia_snapshot: unknown workload {name}")
    described = {
        w.name: {
            "image": image.name,
            "archive_bytes": archive.stat().st_size,
            "env": w.env,
            "main": w.main,
            "serving": f"GET /health 200 on port {w.port}",
            "memory_limit": None,
            **({"prompt": w.prompt.decode()} if w.prompt is not None else {}),
        }
        for w in works
    }
    return works, described


def state(sample: dict[str, Any]) -> str | None:
    """What a restored copy answers: the CPU worker's /generate text, or the Dynamo worker's health status
    and its generate endpoint's (its other endpoints carry per-worker names)."""
    if "generate" in sample:
        return str(sample["generate"].get("text"))
    if "health" in sample:
        health = sample["health"] or {}
        return json.dumps(
            {"status": health.get("status"), "generate": (health.get("endpoints") or {}).get("generate")}
        )
    return None


def main() -> int:
    args = parse_args()
    peer = Peer(args.nv_source.resolve(), args.nv_bin.expanduser().resolve(), tool("criu"), tool("helm"))
    problem = peer.missing() or (None if os.geteuid() == 0 else "needs root (the real kubelet node)")
    if problem:
        print(f"vs_nvidia_snapshot: {problem}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "benchmark": "PodSnapshot created -> Ready; restore pod created -> GET /health 200; one node, "
        "the same workers; NVIDIA's operator and agent, then ours",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "nproc": os.cpu_count(),
            "kernel": platform.release(),
            "machine": platform.machine(),
            "loadavg_at_start": os.getloadavg(),
        },
        "restores_each": args.restores,
    }
    with tempfile.TemporaryDirectory(prefix="vs-nvidia-") as tmp:
        work_root = args.workdir or Path(tmp)
        works, result["workloads"] = workloads(args.workloads.split(","), work_root)
        sides: dict[str, dict[str, Any]] = {}
        try:
            sides["nvidia"] = run_nvidia(peer, works, work_root / "nvidia", args)
        except Exception as e:
            sides["nvidia"] = failed(e)
            log(f"nvidia FAILED: {e}")
        if args.skip_ours:
            sides["ours"] = {"error": "not run (--skip-ours)"}
        else:
            try:
                sides["ours"] = asyncio.run(run_ours(works, work_root / "ours", args.restores))
            except Exception as e:
                sides["ours"] = failed(e)
                log(f"ours FAILED: {e}")
    rc = 0
    for name, side in sides.items():
        for wl in side.setdefault("workloads", {}).values():
            wl["restore"] = summarize(wl)
            rc = rc or (0 if wl["restore"]["n"] and not wl["restore"]["failures"] else 1)
        result[name] = side
        rc = rc or (1 if "error" in side or len(side["workloads"]) < len(works) else 0)
    result["same_worker_state"] = {}
    result["ratios_ours_over_theirs"] = {}
    for w in works:
        per = {n: (s["workloads"].get(w.name) or {}) for n, s in sides.items()}
        seen = {n: sorted({x for x in map(state, p.get("samples") or []) if x}) for n, p in per.items()}
        answers = {x for xs in seen.values() for x in xs}
        result["same_worker_state"][w.name] = {"answers": seen, "identical": len(answers) == 1}
        result["ratios_ours_over_theirs"][w.name] = ratios(per["ours"], per["nvidia"])
    # Other work on the machine during the run shows here (the 1, 5, 15 minute load averages).
    result["host"]["loadavg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    table = {
        f"{n}/{w}": {k: wl["restore"].get(k) for k in ("ok", "p50_s", "p95_s")}
        for n, s in sides.items()
        for w, wl in s["workloads"].items()
    }
    log(f"{json.dumps(table)}\nratios ours/theirs: {json.dumps(result['ratios_ours_over_theirs'])}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
