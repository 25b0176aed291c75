"""The demo's story, step by step, with every time measured as it happens: a DGD in Auto mode cold-starts
its first worker while its checkpoint is taken, load makes a DynamoScalingPolicy scale it up by restore,
a killed worker is replaced by restore, and the load going away scales it back down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.views import PodSnapshotContentView, PodSnapshotView
from dynamo_snapshot.artifact import artifact_key
from dynamo_snapshot.kube import DELETED, POD, Informer, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import CHECKPOINT, POD_SNAPSHOT, POD_SNAPSHOT_CONTENT, SCALING_POLICY
from dynamo_snapshot_dev.demo.stack import (
    CPU_WORKER,
    NAMESPACE,
    WORKER_PORT,
    DemoError,
    Endpoint,
    Stack,
    repo_env,
)
from dynamo_snapshot_dev.demo.traffic import Load, Sample, Timeline
from dynamo_snapshot_dev.localcluster.realnode import REAL_NODE_TAINT, RealNode

GRAPH, SERVICE = "demo", "CpuWorker"
SELECTOR = f"{protocol.LABEL_GRAPH}={GRAPH}"
T = TypeVar("T")


@dataclass
class Profile:
    """How big and how long: the default shows the story at a readable pace, `quick` is for tests."""

    weights_mib: int = 256
    compile_rounds: int = 8_000_000
    peak_rps: float = 60.0
    low_rps: float = 4.0
    max_replicas: int = 4
    scale_down_window_s: int = 20
    show_scale_down: bool = True
    settle_s: float = 10.0  # load kept on after the failover, to show the service whole again

    @classmethod
    def quick(cls) -> Profile:
        return cls(
            weights_mib=64,
            # The worker's own default: the cold start's work has to outweigh a pod's fixed start-up
            # (about a second on the kubelet node), or a slow machine's restore is no faster.
            compile_rounds=3_000_000,
            peak_rps=40.0,
            max_replicas=3,
            show_scale_down=False,
            settle_s=3.0,
        )


@dataclass
class PodRecord:
    name: str
    mode: str
    seen: float
    node: str | None = None
    serving: float | None = None
    gone: float | None = None
    restore_timings: dict[str, float] = field(default_factory=dict)

    @property
    def startup_s(self) -> float | None:
        return None if self.serving is None else self.serving - self.seen


@dataclass
class Results:
    cold_start_s: float | None = None
    checkpoint_s: float | None = None
    artifact_mib: float | None = None
    restore_s: list[float] = field(default_factory=list)
    restore_phases: dict[str, float] = field(default_factory=dict)
    failover_s: float | None = None
    scaled_to: int | None = None
    scaled_down_to: int | None = None
    requests_ok: int = 0
    requests_failed: int = 0


def kubelet_worker_spec(node: RealNode, env: dict[str, str], *, port: int, memory: str | None = None) -> Obj:
    """The extraPodSpec that runs the CPU reference worker's image on the real node, listening on its
    pod IP at ``port``, Ready once it serves."""
    main: Obj = {
        "image": node.worker_image.name,
        "imagePullPolicy": "Never",
        "env": [
            {"name": k, "value": v}
            for k, v in {**env, "WORKER_HOST": "0.0.0.0", "WORKER_PORT": str(port)}.items()
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1},
    }
    if memory is not None:
        main["resources"] = {"limits": {"memory": memory}}
    return {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        "dnsPolicy": "Default",
        "terminationGracePeriodSeconds": 2,
        "mainContainer": main,
    }


def worker_graph(name: str, service: str, extra_pod_spec: Obj, *, replicas: int = 1, gpus: int = 0) -> Obj:
    """A DynamoGraphDeployment of one service of the CPU reference worker, in Auto mode."""
    spec: Obj = {"componentType": "worker", "replicas": replicas, "extraPodSpec": extra_pod_spec}
    if gpus:
        spec["resources"] = {"limits": {"gpu": str(gpus)}}
    spec["checkpoint"] = {
        "enabled": True,
        "mode": "Auto",
        "identity": {"model": "cpu-reference", "backendFramework": "vllm"},
    }
    return {
        "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {"backendFramework": "vllm", "services": {service: spec}},
    }


def dgd_manifest(profile: Profile, stack: Stack) -> Obj:
    """The demo's graph. On the kubelet node its pods run the worker image there; on kwok nodes the
    agents launch this checkout's worker, which registers where it listens in the demo's endpoint
    directory (the fake nodes offer GPUs, so it asks for one)."""
    env = {
        "WORKER_WEIGHTS_MIB": str(profile.weights_mib),
        "WORKER_COMPILE_ROUNDS": str(profile.compile_rounds),
    }
    if stack.real_node is not None:
        return worker_graph(GRAPH, SERVICE, kubelet_worker_spec(stack.real_node, env, port=WORKER_PORT))
    env.update(repo_env(), WORKER_ENDPOINT_DIR=str(stack.endpoint_dir))
    launched = {
        "mainContainer": {
            "image": "local/cpu-reference-worker:demo",
            "command": [sys.executable, str(CPU_WORKER)],
            "env": [{"name": k, "value": v} for k, v in env.items()],
        }
    }
    return worker_graph(GRAPH, SERVICE, launched, gpus=1)


def policy_manifest(profile: Profile) -> Obj:
    return {
        "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
        "kind": "DynamoScalingPolicy",
        "metadata": {"name": "demo-queue"},
        "spec": {
            "target": {"dgdName": GRAPH, "serviceName": SERVICE},
            "minReplicas": 1,
            "maxReplicas": profile.max_replicas,
            "metrics": [
                {"name": "waiting", "query": "sum(vllm:num_requests_waiting)", "targetPerReplica": 4}
            ],
            "evaluationIntervalSeconds": 1,
            "scaleDown": {
                "stabilizationWindowSeconds": profile.scale_down_window_s,
                "graceSeconds": 0,
                "maxStep": profile.max_replicas,
            },
        },
    }


class Changes:
    """Tells waiters that something the story waits on changed: a watch event, a worker now serving, the
    follower task ending. A waiter takes `next()` before it checks, so a change that lands between its
    check and its wait still wakes it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def next(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()


class Scenario:
    def __init__(self, stack: Stack, profile: Profile, say: Callable[[str], None]) -> None:
        self.stack = stack
        self.profile = profile
        self.say = say
        assert stack.kube is not None
        self.kube: Kube = stack.kube
        self.pods: dict[str, PodRecord] = {}
        self.timeline = Timeline()
        self.results = Results()
        # What the load generator's thread sends to; replaced whole by the follower, never mutated.
        self.serving: list[Endpoint] = []
        self.load = Load(lambda: self.serving)
        self.desired = 0
        self._changes = Changes()
        self._pod_watch = Informer(self.kube, POD, namespace=NAMESPACE, label_selector=SELECTOR)
        # The DGD is written and watched at v1beta1, the version its CRD stores (served with or without
        # the chart's conversion webhook), and read in v1alpha1's shape, as dgd_manifest writes it.
        self._dgds = DgdClient(self.kube)
        self._dgd_watch = Informer(
            self.kube,
            self._dgds.version.kind,
            namespace=NAMESPACE,
            field_selector=f"metadata.name={GRAPH}",
            transform=self._dgds.version.view,
        )
        self._checkpoint_watch = Informer(self.kube, CHECKPOINT, namespace=NAMESPACE)
        self._pod_watch.add_handler(self._on_pod)
        self._dgd_watch.add_handler(self._on_dgd)
        self._checkpoint_watch.add_handler(self._on_checkpoint)
        self._follower: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ watching
    @property
    def _watches(self) -> tuple[Informer, ...]:
        return (self._pod_watch, self._dgd_watch, self._checkpoint_watch)

    async def _on_pod(self, etype: str, pod: Obj, old: Obj | None) -> None:
        now = self.timeline.now()
        meta = pod["metadata"]
        name = meta["name"]
        rec = self.pods.get(name)
        # A pod being deleted no longer serves the story, whatever its finalizers still hold it for.
        if etype == DELETED or meta.get("deletionTimestamp"):
            if rec is not None and rec.gone is None:
                rec.gone = now
                self.stack.forget_endpoint(name)
        else:
            if rec is None:
                mode = meta["labels"].get(protocol.LABEL_START_MODE, "?")
                rec = self.pods[name] = PodRecord(name, mode, now)
            rec.node = (pod.get("spec") or {}).get("nodeName")
            timings = (meta.get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_TIMINGS)
            if timings and not rec.restore_timings:
                rec.restore_timings = {k: float(v) for k, v in json.loads(timings).items()}
        self._changes.notify()

    async def _on_dgd(self, etype: str, dgd: Obj, old: Obj | None) -> None:
        if etype != DELETED:
            self.desired = int(dgd["spec"]["services"][SERVICE].get("replicas") or 0)
            self._changes.notify()

    async def _on_checkpoint(self, etype: str, ckpt: Obj, old: Obj | None) -> None:
        self._changes.notify()

    async def _follow(self) -> None:
        """What no watch reports: which registered workers answer their health check, and the samples of
        the timeline's plot."""
        next_sample = 0.0
        while True:
            now = self.timeline.now()
            await self._check_serving()
            if now >= next_sample:
                serving = sum(1 for r in self.pods.values() if r.serving is not None and r.gone is None)
                self.timeline.samples.append(
                    Sample(now, self.load.rps, self.load.in_flight, self.desired, serving)
                )
                next_sample = now + 0.5
            await asyncio.sleep(0.1)

    async def _check_serving(self) -> None:
        endpoints = self.stack.workers
        live = {r.name for r in self.pods.values() if r.serving is not None and r.gone is None}
        self.serving = [e for name, e in sorted(endpoints.items()) if name in live]
        waiting = [
            r for r in self.pods.values() if r.serving is None and r.gone is None and r.name in endpoints
        ]
        if not waiting:
            return
        healthy = await asyncio.gather(*(asyncio.to_thread(endpoints[r.name].healthy) for r in waiting))
        now = self.timeline.now()
        for rec, ok in zip(waiting, healthy, strict=True):
            if ok:
                rec.serving = now
                self.say(f"  pod {rec.name} ({rec.mode}) serving after {rec.startup_s:.2f}s on {rec.node}")
                self._changes.notify()

    async def _start_watching(self, within: float = 30) -> None:
        for watch in self._watches:
            watch.start()
        # Synced before the DGD is applied, so that its pods' times start at their ADDED events.
        try:
            async with asyncio.timeout(within):
                for watch in self._watches:
                    await watch.wait_synced()
        except TimeoutError:
            raise DemoError(
                f"timed out after {within:.0f}s listing the demo's pods, DGDs and checkpoints"
            ) from None
        self._follower = asyncio.create_task(self._follow(), name="demo-follower")
        self._follower.add_done_callback(lambda _: self._changes.notify())

    async def _stop_watching(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        for watch in self._watches:
            await watch.stop()

    async def _until(self, what: str, check: Callable[[], T | None], within: float) -> T:
        """`check`'s first answer other than None, checked again at every change rather than on a timer."""
        try:
            async with asyncio.timeout(within):
                while True:
                    changed = self._changes.next()
                    if self._follower is not None and self._follower.done():
                        self._follower.result()  # raises what stopped it
                        raise DemoError("the demo's follower task stopped")
                    got = check()
                    if got is not None:
                        return got
                    await changed.wait()
        except TimeoutError:
            raise DemoError(f"timed out after {within:.0f}s waiting for {what}") from None

    # ------------------------------------------------------------------ the story
    async def run(self) -> Results:
        self.load.start()
        try:
            await self._start_watching()
            await self._cold_start_and_checkpoint()
            await self._scale_up_by_restore()
            await self._failover()
            if self.profile.show_scale_down:
                await self._scale_down()
        finally:
            self.load.stop()
            await self._stop_watching()
        self.results.requests_ok, self.results.requests_failed = self.load.ok, self.load.failed
        return self.results

    async def _cold_start_and_checkpoint(self) -> None:
        self.say(
            "[1/4] DynamoGraphDeployment in Auto mode: the first worker starts cold, the checkpoint is taken"
        )
        self.timeline.mark("DGD applied")
        applied = self.timeline.now()
        await self._dgds.create(dgd_manifest(self.profile, self.stack), NAMESPACE)

        def cold_serving() -> PodRecord | None:
            return next((r for r in self.pods.values() if r.mode == "cold" and r.serving is not None), None)

        cold = await self._until("the cold-started worker to serve", cold_serving, 300)
        self.results.cold_start_s = cold.startup_s
        self.timeline.mark("cold worker serving")

        def checkpoint_ready() -> Obj | None:
            items = self._checkpoint_watch.list()
            ready = [c for c in items if (c.get("status") or {}).get("phase") == "Ready"]
            failed = [c for c in items if (c.get("status") or {}).get("phase") == "Failed"]
            if failed:
                raise DemoError(f"checkpoint failed: {failed[0]['status'].get('message')}")
            return ready[0] if ready else None

        ckpt = await self._until("the checkpoint to be Ready", checkpoint_ready, 300)
        self.results.checkpoint_s = self.timeline.now() - applied
        self.timeline.mark("checkpoint Ready")
        # The artifact is its PodSnapshot's: the one the checkpoint's SnapshotJob made.
        snapshot = await self.kube.get(POD_SNAPSHOT, ckpt["status"]["podSnapshotName"], NAMESPACE)
        key = artifact_key(NAMESPACE, snapshot["metadata"]["uid"])
        content = await self.kube.get(POD_SNAPSHOT_CONTENT, PodSnapshotView(snapshot).bound_content)
        store = self.stack.node_store(PodSnapshotContentView(content).source_node)
        artifact = await asyncio.to_thread(store.open, key)
        self.results.artifact_mib = artifact.manifest.total_bytes / 2**20
        self.say(
            f"  checkpoint {ckpt['metadata']['name']} Ready {self.results.checkpoint_s:.1f}s after the DGD "
            f"was applied ({self.results.artifact_mib:.0f} MiB artifact)"
        )

    async def _scale_up_by_restore(self) -> None:
        p = self.profile
        self.say(
            f"[2/4] load at {p.peak_rps:.0f} req/s, a DynamoScalingPolicy on the queue: scale-up by restore"
        )
        await self.kube.create(SCALING_POLICY, policy_manifest(p), NAMESPACE)
        self.load.rps = p.peak_rps
        self.timeline.mark("load up")

        def scaled() -> list[PodRecord] | None:
            restored = [r for r in self.pods.values() if r.mode == "restore" and r.serving is not None]
            return restored if self.desired >= 2 and len(restored) >= self.desired - 1 else None

        restored = await self._until("restored replicas to serve", scaled, 180)
        self.results.scaled_to = self.desired
        self.results.restore_s = [r.startup_s for r in restored if r.startup_s is not None]
        phases: dict[str, list[float]] = {}
        for r in restored:
            for k, v in r.restore_timings.items():
                phases.setdefault(k, []).append(v)
        self.results.restore_phases = {k: statistics.median(v) for k, v in phases.items()}
        self.timeline.mark(f"scaled to {self.desired}")

    async def _failover(self) -> None:
        self.say("[3/4] a restored worker's process is killed: the replacement is restored too")
        victim = next(r for r in self.pods.values() if r.mode == "restore" and r.serving and r.gone is None)
        pod = self._pod_watch.get(f"{NAMESPACE}/{victim.name}")
        if pod is None:
            raise DemoError(f"pod {victim.name} is gone")
        pid = await self.stack.worker_pid(pod)
        if pid is None:
            raise DemoError(f"could not find the process of pod {victim.name}")
        before = set(self.pods)
        killed = self.timeline.now()
        self.stack.forget_endpoint(victim.name)
        os.kill(pid, signal.SIGKILL)
        self.timeline.mark(f"killed {victim.name}")
        self.say(f"  killed pid {pid} of {victim.name} on {victim.node}")

        def replaced() -> PodRecord | None:
            return next(
                (r for n, r in self.pods.items() if n not in before and r.mode == "restore" and r.serving),
                None,
            )

        new = await self._until("the replacement worker to serve", replaced, 120)
        assert new.serving is not None
        self.results.failover_s = new.serving - killed
        self.timeline.mark("replacement serving")
        await asyncio.sleep(self.profile.settle_s)
        self.say(
            f"  {new.name} restored on {new.node}, serving {self.results.failover_s:.2f}s after the kill"
        )

    async def _scale_down(self) -> None:
        self.say(f"[4/4] load drops to {self.profile.low_rps:.0f} req/s: the policy scales back down")
        self.load.rps = self.profile.low_rps
        self.timeline.mark("load down")
        peak = self.desired

        def down() -> int | None:
            return self.desired if self.desired < peak else None

        window = self.profile.scale_down_window_s
        self.results.scaled_down_to = await self._until("the scale-down", down, window + 60)
        self.timeline.mark(f"scaled to {self.results.scaled_down_to}")

        # The policy may step down more than once; show where it settles (minReplicas is 1), briefly.
        def settled() -> int | None:
            return self.desired if self.desired <= 1 else None

        with contextlib.suppress(DemoError):  # not there in time: the table says where it stood
            await self._until("the scale-down to settle", settled, window + 15)
        if self.desired != self.results.scaled_down_to:
            self.results.scaled_down_to = self.desired
            self.timeline.mark(f"scaled to {self.desired}")
        await asyncio.sleep(3)  # the replicas going away, on the plot

    def summary(self) -> dict[str, Any]:
        return {
            "results": asdict(self.results),
            "pods": [asdict(r) for r in self.pods.values()],
            "timeline": [asdict(s) for s in self.timeline.samples],
            "marks": self.timeline.marks,
            "storage": self.stack.storage_report(),
        }
