"""The Auto-mode story in kubelet pods on one machine, timed: the local control plane, the real kubelet +
containerd node (with the machine's GPUs through the device plugin and CDI where it has them), this
checkout's controller and node agent, and a DynamoGraphDeployment of the reference worker in Auto mode.

    python3 benchmarks/gpu/pod_story.py --worker gpu --size 1g --out $OUT     # the GPU machine
    python3 benchmarks/gpu/pod_story.py --worker cpu --out /tmp/story         # here: the same story, CPU

1. the DGD's first pod cold-starts (an empty compile cache) while its SnapshotJob's pod is checkpointed in
   place (CUDA checkpoint of the container's process, then CRIU);
2. scaled to 2 (one restore, from the disk with --drop-caches) and then to --replicas (from the page
   cache), the new pods are restored inside their own containers; each answers on its pod IP with the
   cold worker's tokens, runs under its own pod's cgroup and gets `nvidia.com/Restored`;
3. a restored worker's process is killed and its replacement is restored;
4. (--bad-inputs) a restore pod that gets no GPU is refused without a half-restored process.

Times are taken by this driver, which watches the pods every 50 ms: pod seen → its worker answers /health
(`serving_s`) → its first token equals the cold worker's (`first_token_s`) → its whole answers do
(`answers_s`). `timeline_s` says when each pod was scheduled, got its IP, ran its container and got each
Restored reason; the agent's `await_container` phase is its wait for the kubelet. Results go to
OUT/gpu-pod-<worker>-<size>.json after every step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.host import log_gaps, log_span  # noqa: E402
from benchmarks.gpu.story_missing_device import spec_naming_a_missing_device  # noqa: E402
from benchmarks.gpu.story_wrong_gpu import artifact_from_another_gpu  # noqa: E402
from dynamo_snapshot.agent.watcher import NodeAgent  # noqa: E402
from dynamo_snapshot.api import protocol  # noqa: E402
from dynamo_snapshot.cli import agent_cmd  # noqa: E402
from dynamo_snapshot.cli.agent_cmd import AgentConfig  # noqa: E402
from dynamo_snapshot.cli.controller_cmd import build_controller  # noqa: E402
from dynamo_snapshot.controller.config import CONTROLLER_NAME  # noqa: E402
from dynamo_snapshot.controller.manager import ControllerConfig  # noqa: E402
from dynamo_snapshot.kube import POD, Kube, Obj, load_client  # noqa: E402
from dynamo_snapshot.kube.dgd_versions import DgdClient  # noqa: E402
from dynamo_snapshot_dev.localcluster import LocalCluster  # noqa: E402
from dynamo_snapshot_dev.localcluster.cluster import ClusterOptions  # noqa: E402
from dynamo_snapshot_dev.localcluster.realnode import REAL_NODE_TAINT, RUNC_ROOT, RealNode, RealNodeOptions  # noqa: E402

NAMESPACE = "story"
GRAPH, SERVICE = "story", "worker"
PORT = 8000
# The GPU worker's model files, prepared on the host once and mounted read-only into every pod (a
# node-local model cache, as a production node has one).
MODELS = Path("/var/tmp/dsnap-models")
# Token ids below the smallest vocabulary of the reference worker's shapes (tiny: 2048).
PROMPTS = [[1, 2, 3, 4, 5, 6], [100, 200, 300, 400, 500], [7, 11, 13, 17, 19, 23, 29]]


def say(msg: str) -> None:
    print(f"[story {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class PodTimes:
    name: str
    mode: str  # cold | restore | snapshot
    seen: float
    ip: str | None = None
    serving: float | None = None
    first_token: float | None = None
    answers: float | None = None
    identical: bool | None = None  # its answers equal the cold pod's
    answer: Any = None
    selftest_identical: bool | None = None  # the restored worker's own check against its checkpoint
    restored_condition: str | None = None
    restore_timings: dict[str, float] = field(default_factory=dict)
    # The agent's work beside its phases (its "restored" log record): e.g. writable_layer_rest.
    restore_overlapped: dict[str, float] = field(default_factory=dict)
    resume: dict[str, Any] = field(default_factory=dict)  # the restored worker's own account
    gone: float | None = None
    # When the story's 50 ms poll first saw each step of the pod's start (monotonic): where the time
    # between the pod's creation and the agent's restore goes.
    steps: dict[str, float] = field(default_factory=dict)

    def step(self, name: str, reached: bool) -> None:
        if reached and name not in self.steps:
            self.steps[name] = time.monotonic()

    def since_seen(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.seen, 3)

    def summary(self) -> dict[str, Any]:
        return {
            "pod": self.name,
            "mode": self.mode,
            "serving_s": self.since_seen(self.serving),
            "first_token_s": self.since_seen(self.first_token),
            "answers_s": self.since_seen(self.answers),
            "output_identical_to_cold_pod": self.identical,
            "selftest_identical": self.selftest_identical,
            "restored_condition": self.restored_condition,
            "restore_phases": self.restore_timings,
            "restore_overlapped": self.restore_overlapped,
            "resume": self.resume,
            "timeline_s": {
                k: self.since_seen(v) for k, v in sorted(self.steps.items(), key=lambda kv: kv[1])
            },
        }


class _RestoredRecords(logging.Handler):
    """The agent's "restored" log records: what it did beside its phases, onto the story's pods."""

    def __init__(self, story: Story) -> None:
        super().__init__()
        self.story = story

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() != "restored":
            return
        # The agent's workload key: "<namespace>_<name>_<uid8>" (neither name holds an underscore).
        name = str(getattr(record, "pod", "")).split("_")[1:2]
        rec = self.story.pods.get(name[0]) if name else None
        if rec is not None:
            rec.restore_overlapped = dict(getattr(record, "overlapped", {}))


def _http(address: str, path: str, body: Any = None, timeout: float = 2.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


class Worker:
    """How the story asks a worker: the GPU reference worker's token API, or the CPU worker's text."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def ask(self, address: str, tokens: int) -> Any:
        if self.kind == "gpu":
            status, answer = _http(
                address, "/generate", {"prompts": PROMPTS, "max_new_tokens": tokens}, timeout=60
            )
            return answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
        answers = []
        for prompt in ("the same question", "another one"):
            req = urllib.request.Request(f"http://{address}/generate", data=prompt.encode(), method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    answers.append(json.loads(r.read())["text"])
            except (OSError, ValueError, KeyError):
                return None
        return answers

    def first(self, answer: Any) -> Any:
        return [t[:1] for t in answer] if self.kind == "gpu" and answer is not None else answer


@dataclass
class Story:
    args: argparse.Namespace
    results: dict[str, Any] = field(default_factory=dict)
    pods: dict[str, PodTimes] = field(default_factory=dict)
    cluster: LocalCluster | None = None
    node: RealNode | None = None
    kube: Kube | None = None
    agent: NodeAgent | None = None
    reference: Any = None
    _api: Any = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    @property
    def work(self) -> Path:
        return Path(self.args.work)

    @property
    def out_file(self) -> Path:
        return Path(self.args.out) / f"gpu-pod-{self.args.worker}-{self.args.size}.json"

    def save(self) -> None:
        self.results["pods"] = [p.summary() for p in self.pods.values()]
        self.out_file.parent.mkdir(parents=True, exist_ok=True)
        self.out_file.write_text(json.dumps(self.results, indent=1, default=str))

    def phase(self, name: str, started: float) -> None:
        self.results.setdefault("phases_s", {})[name] = round(time.monotonic() - started, 2)
        say(f"{name}: {time.monotonic() - started:.1f}s")
        self.save()

    # ------------------------------------------------------------------ bring-up
    async def start(self) -> None:
        t = time.monotonic()
        # A story is one fresh cluster: what an earlier run left (its etcd, its artifacts) would be read
        # back as this run's state.
        await asyncio.to_thread(shutil.rmtree, self.work, True)
        self.work.mkdir(parents=True)
        # The in-process controller's and agent's own account, for the run's logs.
        handler = logging.FileHandler(self.work / "controller-and-agent.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger("dynamo_snapshot").addHandler(handler)
        logging.getLogger("dynamo_snapshot").addHandler(_RestoredRecords(self))
        logging.getLogger("dynamo_snapshot").setLevel(logging.INFO)
        self.cluster = LocalCluster(self.work / "cluster", options=ClusterOptions())
        await asyncio.to_thread(self.cluster.start, progress=say)
        await asyncio.to_thread(self.cluster.install_crds)
        self.cluster.kubectl("create", "namespace", NAMESPACE)
        self.phase("control_plane", t)
        t = time.monotonic()
        # One GPU shared by the cold pod, the SnapshotJob's pod, the restores and the bad inputs' pods
        # (time-slicing).
        gpu = self.args.worker == "gpu"
        options = RealNodeOptions(gpus=gpu, gpu_replicas=self.args.replicas + 5 if gpu else 1)
        self.node = await asyncio.to_thread(self.cluster.start_real_node, options, timeout=300, progress=say)
        self.results["node"] = {"gpus": self.node.gpus, "cgroup": str(self.node.facts.cgroup_version)}
        self.phase("real_node", t)
        self._api = await load_client(str(self.cluster.kubeconfig))
        self.kube = Kube(self._api, field_manager="dynamo-snapshot-story")
        config = ControllerConfig(leader_elect=False, metrics_port=0, resync_seconds=30)
        controller = build_controller(Kube(self._api, field_manager=CONTROLLER_NAME), config)
        self._tasks.append(asyncio.create_task(controller.run_until(self._stop), name="controller"))
        base = self.work / "agent"
        agent_config = AgentConfig(
            node_name=self.node.name,
            artifact_root=self.work / "artifacts",
            control_root=base / "control",
            state_root=base / "state",
            runc_root=RUNC_ROOT,
            ready_timeout_seconds=900,
            metrics_port=0,
            health_port=0,
        )
        self.agent = agent_cmd.build(agent_config, Kube(self._api, field_manager=agent_cmd.FIELD_MANAGER))
        self._tasks.append(asyncio.create_task(self.agent.run_until(self._stop), name="agent"))
        self._tasks.append(asyncio.create_task(self._watch_pods(), name="pods"))

    async def image(self) -> str:
        assert self.node is not None
        if self.args.worker == "cpu":
            return self.node.worker_image.name
        from dynamo_snapshot_dev.localcluster.gpu_worker_image import build_and_import_gpu_worker_image

        t = time.monotonic()
        site = [
            Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p.startswith("/tmp/site")
        ]
        ref = await asyncio.to_thread(
            build_and_import_gpu_worker_image,
            self.node.components.ctr,
            self.node.containerd_socket,
            site_dirs=site,
            say=say,
        )
        self.phase("gpu_image", t)
        return ref.name

    async def prepare_model(self) -> None:
        if self.args.worker != "gpu":
            return
        from dynamo_snapshot_dev.localcluster.gpu_worker_image import GPU_PYTHON

        t = time.monotonic()
        model = MODELS / self.args.size
        proc = await asyncio.create_subprocess_exec(
            str(GPU_PYTHON), str(REPO / "examples/reference_worker/worker.py"),
            "--size", self.args.size, "--model-dir", str(model), "--prepare-only",
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        if await proc.wait() != 0:
            raise RuntimeError("preparing the model failed")
        self.phase("prepare_model", t)

    # ------------------------------------------------------------------ the graph
    def main_container(self, image: str) -> Obj:
        env: dict[str, str]
        if self.args.worker == "gpu":
            from dynamo_snapshot_dev.localcluster.gpu_worker_image import gpu_worker_command, gpu_worker_env

            command = gpu_worker_command(
                self.args.size,
                model_dir=f"/models/{self.args.size}",
                kv_gib=self.args.kv_gib,
                port=PORT,
                flags=["--release-kv", "--decouple-weights"],
            )
            env = gpu_worker_env("/tmp/compile-cache", PORT)
        else:
            command = []
            env = {"WORKER_WEIGHTS_MIB": "64", "WORKER_HOST": "0.0.0.0", "WORKER_PORT": str(PORT)}
        main: Obj = {
            "image": image,
            "imagePullPolicy": "Never",
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1},
        }
        if command:
            main["command"] = command
        if self.args.worker == "gpu":
            main["volumeMounts"] = [{"name": "models", "mountPath": "/models", "readOnly": True}]
        return main

    def graph(self, image: str) -> Obj:
        pod: Obj = {
            "nodeSelector": {"kubernetes.io/hostname": self.node.name if self.node else ""},
            "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
            "dnsPolicy": "Default",
            "terminationGracePeriodSeconds": 2,
            "mainContainer": self.main_container(image),
        }
        if self.args.worker == "gpu":
            pod["volumes"] = [{"name": "models", "hostPath": {"path": str(MODELS), "type": "Directory"}}]
        service: Obj = {"componentType": "worker", "replicas": 1, "extraPodSpec": pod}
        if self.args.worker == "gpu":
            service["resources"] = {"limits": {"gpu": "1"}}
        service["checkpoint"] = {
            "enabled": True,
            "mode": "Auto",
            "identity": {
                "model": f"reference-worker-{self.args.worker}-{self.args.size}",
                "backendFramework": "vllm",
            },
        }
        return {
            "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
            "kind": "DynamoGraphDeployment",
            "metadata": {"name": GRAPH},
            "spec": {"backendFramework": "vllm", "services": {SERVICE: service}},
        }

    # ------------------------------------------------------------------ watching
    async def _watch_pods(self) -> None:
        assert self.kube is not None
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                pods, _ = await self.kube.list_all(POD, NAMESPACE)
                now = time.monotonic()
                names = set()
                for pod in pods:
                    meta = pod["metadata"]
                    names.add(meta["name"])
                    rec = self.pods.get(meta["name"])
                    if rec is None:
                        rec = self.pods[meta["name"]] = PodTimes(meta["name"], _mode(pod), now)
                        say(f"pod {meta['name']} ({rec.mode}) seen")
                    self._update(rec, pod)
                for name, rec in self.pods.items():
                    if name not in names and rec.gone is None:
                        rec.gone = now
            await asyncio.sleep(0.05)

    def _update(self, rec: PodTimes, pod: Obj) -> None:
        st = pod.get("status") or {}
        rec.ip = st.get("podIP") or rec.ip
        rec.step("scheduled", bool(pod["spec"].get("nodeName")))
        rec.step("pod_ip", bool(rec.ip))
        rec.step(
            "container_running",
            any("running" in (c.get("state") or {}) for c in st.get("containerStatuses") or []),
        )
        for c in st.get("conditions") or []:
            if c.get("type") == protocol.POD_CONDITION_RESTORED:
                rec.restored_condition = f"{c.get('status')}/{c.get('reason')}"
                rec.step(f"restored_{c.get('reason')}", True)
        raw = (pod["metadata"].get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_TIMINGS)
        if raw:
            with contextlib.suppress(ValueError):
                rec.restore_timings = json.loads(raw)
        if rec.ip and rec.serving is None and rec.mode != "snapshot":
            asyncio.get_running_loop().create_task(self._probe(rec))

    async def _probe(self, rec: PodTimes) -> None:
        if getattr(rec, "_probing", False):
            return
        rec._probing = True  # type: ignore[attr-defined]
        worker = Worker(self.args.worker)
        address = f"{rec.ip}:{PORT}"
        while rec.serving is None and rec.gone is None and not self._stop.is_set():
            status, _ = await asyncio.to_thread(_http, address, "/health", None, 0.5)
            if status == 200:
                rec.serving = time.monotonic()
                rec.step("serving", True)
                say(f"pod {rec.name} ({rec.mode}) serving {rec.serving - rec.seen:.2f}s after it was seen")
                break
            await asyncio.sleep(0.05)
        if rec.serving is None:
            return
        first = await asyncio.to_thread(worker.ask, address, 1)
        rec.first_token = time.monotonic()
        whole = await asyncio.to_thread(worker.ask, address, 16)
        rec.answers = time.monotonic()
        rec.answer = whole
        if rec.mode == "cold" and self.reference is None:
            self.reference = whole
        if self.reference is not None:
            rec.identical = whole == self.reference and first == worker.first(self.reference)
        self.save()

    async def until(self, what: str, check: Any, within: float) -> Any:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{what}: not within {within:.0f}s")

    # ------------------------------------------------------------------ the story
    async def run(self) -> None:
        assert self.kube is not None
        assert self.cluster is not None
        image = await self.image()
        await self.prepare_model()
        dgds = DgdClient(self.kube)
        t = time.monotonic()
        await dgds.create(self.graph(image), NAMESPACE)
        say("DGD applied (Auto mode)")
        cold = await self.until(
            "the cold pod to answer", lambda: self._one("cold", answered=True), self.args.cold_timeout
        )
        self.results["cold"] = cold.summary()
        self.phase("cold_pod_answers", t)
        await self.until("the checkpoint to be Ready", self._checkpoint_ready, self.args.cold_timeout)
        self.results["checkpoint_ready_after_apply_s"] = round(time.monotonic() - t, 2)
        self.results["artifact_files"] = await asyncio.to_thread(self._artifact_files)
        self.save()
        say("checkpoint Ready")

        t = time.monotonic()
        pods: list[PodTimes] = []
        # One restore alone first (from the disk where --drop-caches), then the rest from the page cache:
        # each pairs with the process-path baseline's restore of the same kind (restore_s, warm_restore).
        for replicas, cache in (
            (2, "dropped" if self.args.drop_caches else "page"),
            (self.args.replicas, "page"),
        ):
            if replicas <= len(pods) + 1:
                continue
            if cache == "dropped":
                # The restore reads the artifact from the disk, as on a node that did not take it.
                await asyncio.to_thread(Path("/proc/sys/vm/drop_caches").write_text, "3\n")
            before = set(self.pods)
            await dgds.set_replicas(GRAPH, NAMESPACE, SERVICE, replicas)
            wanted = replicas - 1 - len(pods)

            def restored(before: set[str] = before, wanted: int = wanted) -> list[PodTimes] | None:
                done = [
                    p for n, p in self.pods.items() if n not in before and p.mode == "restore" and p.answers
                ]
                return done if len(done) >= wanted else None

            step = await self.until(f"{wanted} restore pod(s) to answer ({cache} cache)", restored, 300)
            for p in step:
                p.selftest_identical = await self._selftest(p.name)
                self.results.setdefault("restores", []).append({**p.summary(), "cache": cache})
            pods += step
            self.save()
        self.results["restored_pods_agree"] = all(p.answer == pods[0].answer for p in pods)
        self.results["cgroups"] = {p.name: await self._cgroup_of(p.name) for p in pods}
        self.results["criu_restore_log_gaps"] = self._criu_restore_logs()
        self.phase("scale_up_by_restore", t)

        t = time.monotonic()
        victim = pods[0]
        pid = await self._worker_pid(victim.name)
        before = set(self.pods)
        killed = time.monotonic()
        if pid is None:
            raise RuntimeError(f"no worker process found in {victim.name}")
        os.kill(pid, signal.SIGKILL)
        say(f"killed pid {pid} of {victim.name}")

        def replaced() -> PodTimes | None:
            return next(
                (p for n, p in self.pods.items() if n not in before and p.mode == "restore" and p.answers),
                None,
            )

        new = await self.until("the replacement to answer", replaced, 300)
        new.selftest_identical = await self._selftest(new.name)
        self.results["failover"] = {
            **new.summary(),
            "kill_to_serving_s": round((new.serving or 0) - killed, 3),
            "kill_to_first_token_s": round((new.first_token or 0) - killed, 3),
        }
        self.results["criu_restore_log_gaps"] = self._criu_restore_logs()
        self.phase("failover", t)
        bad = self.results["bad_inputs"] = {}
        replicas = self.args.replicas

        async def one_more() -> None:
            nonlocal replicas
            replicas += 1
            await dgds.set_replicas(GRAPH, NAMESPACE, SERVICE, replicas)

        if self.args.worker == "gpu":
            assert self.node is not None
            bad["restore_pod_without_gpu"] = await self.restore_without_gpu(new.name)
            self.save()
            # Before the wrong-GPU phase: that one leaves the checkpoint's recorded digest unrestorable.
            try:
                bad["cdi_spec_naming_a_missing_device"] = await spec_naming_a_missing_device(
                    self.cluster, self.node.name, self.node.cdi_dir, NAMESPACE, one_more, lambda: self.pods
                )
            except TimeoutError as e:
                # Recorded as the finding; the wrong-GPU phase still runs.
                bad["cdi_spec_naming_a_missing_device"] = {"failed": str(e)}
            say(f"CDI spec naming a missing device: {bad['cdi_spec_naming_a_missing_device']}")
            self.save()
        bad["artifact_from_another_gpu"] = await artifact_from_another_gpu(
            self.cluster, self.work / "artifacts", NAMESPACE, one_more, lambda: self.pods
        )
        say(f"artifact from another GPU: {bad['artifact_from_another_gpu']}")
        self.save()

    async def restore_without_gpu(self, like: str) -> dict[str, Any]:
        """A restore pod like ``like`` (the same checkpoint, node and image) that asks for no GPU: the agent
        must refuse it (Restored False) and put no process into it."""
        assert self.kube is not None
        pod = await self.kube.get(POD, like, NAMESPACE)
        meta = pod["metadata"]
        spec = pod["spec"]
        for c in spec.get("containers") or []:
            for part in ("limits", "requests"):
                (c.get("resources") or {}).get(part, {}).pop(protocol.RESOURCE_GPU, None)
        name = "restore-without-gpu"
        # Only the restore-from annotation: nothing of the agent's or the controller's.
        source = meta.get("annotations") or {}
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "annotations": {protocol.ANNOTATION_RESTORE_FROM: source[protocol.ANNOTATION_RESTORE_FROM]},
                # Owned by the graph as its pods are (a pod creator of the namespace may write this: see
                # docs/security.md), without the labels the graph counts its replicas by.
                "ownerReferences": meta.get("ownerReferences") or [],
            },
            "spec": {k: v for k, v in spec.items() if k not in ("nodeName",)}
            | {"nodeName": spec["nodeName"]},
        }
        await self.kube.create(POD, body, NAMESPACE)
        say(f"pod {name}: a restore that asks for no GPU")
        deadline = time.monotonic() + 90
        found: dict[str, Any] = {"refused": False}
        while time.monotonic() < deadline:
            got = await self.kube.get(POD, name, NAMESPACE)
            restored: dict[str, Any] = next(
                (
                    c
                    for c in (got.get("status") or {}).get("conditions") or []
                    if c.get("type") == protocol.POD_CONDITION_RESTORED
                ),
                {},
            )
            done = restored.get("status") == "True" or restored.get("reason") == "RestoreFailed"
            found = {
                "refused": restored.get("status") == "False",
                **{k: restored.get(k) for k in ("reason", "message")},
            }
            if done:
                break
            await asyncio.sleep(0.5)
        ip = (got.get("status") or {}).get("podIP")
        status = (await asyncio.to_thread(_http, f"{ip}:{PORT}", "/health", None, 1.0))[0] if ip else 0
        found["worker_answers"] = status == 200
        found["pid_in_pod"] = await self._worker_pid(name)
        say(f"pod {name}: {found}")
        return found

    def _criu_restore_logs(self) -> dict[str, Any]:
        """CRIU's restore log of each pod restored so far: its span and its longest waits, to set against
        the process-path restore's (the baseline's `criu_log_gaps`)."""
        found: dict[str, Any] = {}
        for log in sorted((self.work / "agent").rglob("restore/restore.log")):
            found[log.parent.parent.name] = {"logged_s": log_span(log), "gaps": log_gaps(log)}
        return found

    def _artifact_files(self) -> dict[str, int]:
        """The checkpoint's files and their sizes, largest first (the writable layer's diff among them)."""
        sizes = {
            str(f.relative_to(self.work / "artifacts")): f.stat().st_size
            for f in (self.work / "artifacts").rglob("*")
            if f.is_file()
        }
        return dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:12])

    def _one(self, mode: str, *, answered: bool) -> PodTimes | None:
        return next(
            (p for p in self.pods.values() if p.mode == mode and (p.answers if answered else p.serving)), None
        )

    def _checkpoint_ready(self) -> bool:
        assert self.cluster is not None
        got = self.cluster.kubectl(
            "get",
            "dynamocheckpoints",
            "-n",
            NAMESPACE,
            "-o",
            "jsonpath={.items[*].status.phase}",
            check=False,
        )
        if "Failed" in got.stdout:
            shown = self.cluster.kubectl("get", "dynamocheckpoints", "-n", NAMESPACE, "-oyaml", check=False)
            raise RuntimeError(f"checkpoint failed: {shown.stdout[-2000:]}")
        return "Ready" in got.stdout

    async def _worker_pid(self, pod_name: str) -> int | None:
        assert self.kube is not None
        assert self.agent is not None
        from dynamo_snapshot.agent.watcher import workload_key

        pod = await self.kube.get(POD, pod_name, NAMESPACE)
        workload = await self.agent.runtime.find(workload_key(pod))
        return workload.pid if workload is not None else None

    async def _selftest(self, pod_name: str) -> bool | None:
        """What the restored worker wrote after its resume (resume.json in its control directory, read
        through the pod's emptyDir on the node): whether its self-test gave the tokens it gave before the
        checkpoint. The cold pod is another process whose kernels were compiled apart: on the reference
        worker's random weights its tokens may differ, so the restore is held to its own source."""
        assert self.kube is not None
        assert self.node is not None
        if self.args.worker != "gpu":
            return None  # the CPU worker writes no resume.json
        pod = await self.kube.get(POD, pod_name, NAMESPACE)
        # The main container's own subdirectory of the volume (its mount's subPath), where it has one.
        mounts = pod["spec"]["containers"][0].get("volumeMounts") or []
        sub = next((m.get("subPath") or "" for m in mounts if m["name"] == protocol.CONTROL_VOLUME_NAME), "")
        path = (
            self.node.kubelet_root / "pods" / pod["metadata"]["uid"] / "volumes" / "kubernetes.io~empty-dir"
            / protocol.CONTROL_VOLUME_NAME / sub / "resume.json"
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(await asyncio.to_thread(path.read_text))
                self.pods[pod_name].resume = _resume_summary(doc)
                return bool(doc.get("selftest_identical"))
            await asyncio.sleep(0.2)
        return None

    async def _cgroup_of(self, pod_name: str) -> dict[str, Any]:
        """The restored worker's cgroup, and whether it is its own pod's."""
        assert self.kube is not None
        pid = await self._worker_pid(pod_name)
        pod = await self.kube.get(POD, pod_name, NAMESPACE)
        uid = pod["metadata"]["uid"]
        if pid is None:
            return {"pid": None}
        text = await asyncio.to_thread(Path(f"/proc/{pid}/cgroup").read_text)
        mine = uid.replace("-", "_") in text or uid in text
        return {"pid": pid, "cgroup": text.strip().splitlines()[-1], "in_own_pod": mine}

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout=30)
        if self._api is not None:
            await self._api.close()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)


def _resume_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """From the reference worker's resume.json: how long it took to wake after the agent wrote
    restore-complete (both clocks are the node's), and its reacquire of GPU memory and weights load."""
    offload = doc.get("offload") or {}
    resume_s = offload.get("resume_seconds")
    loads = offload.get("loaded") or []
    woke = None
    if isinstance(resume_s, float) and isinstance(doc.get("restore_complete_at"), float):
        woke = round(doc["resumed_at"] - resume_s - doc["restore_complete_at"], 4)
    return {
        "wake_s": woke,
        "resume_s": resume_s,
        "weights_load": [{k: w.get(k) for k in ("seconds", "gbps", "threads", "direct")} for w in loads],
        "resumed_to_ready_s": round(doc["ready_at"] - doc["resumed_at"], 4) if "ready_at" in doc else None,
    }


def _mode(pod: Obj) -> str:
    meta = pod["metadata"]
    annotations = meta.get("annotations") or {}
    if protocol.ANNOTATION_RESTORE_FROM in annotations:
        return "restore"
    if any(o.get("kind") == "Job" for o in meta.get("ownerReferences") or []):
        return "snapshot"
    return "cold"


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--size", default="1g")
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--cold-timeout", type=float, default=400)
    p.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false", help="restore from the page cache"
    )
    p.add_argument("--work", default="/var/tmp/dsnap-story")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/story-out"))
    args = p.parse_args()
    story = Story(args)
    started = time.monotonic()
    rc = 0
    try:
        await story.start()
        await story.run()
    except Exception as e:  # the results so far are saved with the reason
        story.results["error"] = f"{type(e).__name__}: {e}"
        story.results["traceback"] = traceback.format_exc()[-4000:]
        say(f"FAILED: {e}")
        rc = 1
    finally:
        story.results["total_s"] = round(time.monotonic() - started, 1)
        story.save()
        await story.stop()
    return rc


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
