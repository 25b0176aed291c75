"""The controller and the node agent as real processes, killed with SIGKILL at the worst moments.

Unlike the in-process "controller killed" tests (a cancelled task still runs its ``finally`` blocks), a
SIGKILLed process leaves exactly what it had done: half a CRIU dump in the store's staging, a restore's
pages half unpacked in the scratch, some restore pods of a scale-up, a lost worker force-deleted but not
yet replaced. Each test restarts the killed process
and waits for convergence, while an ``InvariantWatch`` started before anything else records, as it happens,
every moment with more worker pods than replicas plus the surge, two DynamoCheckpoints or two artifacts for
one identity, or a partial artifact visible in the store.

The agent runs in its kwok mode (``--runtime runc --launch-workloads``, as ``dynamo-snapshot-demo --kwok``
runs it): the kwok node's pods become runc containers of the CPU reference worker
(examples/reference_worker/cpu_worker.py, which also runs cold), checkpointed and restored by the real CRIU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pytest
import yaml
from kubernetes_asyncio import client

from dynamo_snapshot.agent.watcher import workload_key
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import compute_identity_hash
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.criu.packed import PACKED_SUFFIX
from dynamo_snapshot.kube import EVENT, POD, ApiError, Kube, Obj
from dynamo_snapshot.kube.dgd_versions import DgdClient
from dynamo_snapshot.kube.kinds import CHECKPOINT
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.cli import CLI
from tests.helpers.invariants import (
    WORKER_SURGE,
    InvariantWatch,
    holds_a_replica,
    leftover_staging,
    worker_owner,
)

pytestmark = [pytest.mark.cluster, pytest.mark.criu]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "examples" / "reference_worker" / "cpu_worker.py"
GRAPH, SERVICE = "killed", "VllmWorker"
IDENTITY = {"model": "cpu-reference", "backendFramework": "vllm"}
HASH = compute_identity_hash(IDENTITY)
RESTORE_STATUS = protocol.per_container(protocol.ANNOTATION_RESTORE_STATUS, "main")
CHECKPOINT_STATUS = protocol.per_container(protocol.ANNOTATION_CHECKPOINT_STATUS, "main")


@dataclass
class Service:
    """One ``dynamo-snapshot`` command as its own process: ``pid`` is the Python interpreter itself."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log: TextIO | None = None
    starts: int = 0
    # Run at this CPU niceness (``nice`` execs the command: the pid stays the interpreter's).
    niceness: int = 0

    def start(self) -> None:
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} already runs"
        if self._log is not None:
            self._log.close()
        self._log = self.log_path.open("a")
        self._log.write(f"----- start {self.starts + 1}\n")
        self._log.flush()
        nice = ["nice", "-n", str(self.niceness)] if self.niceness else []
        self.popen = subprocess.Popen(
            [*nice, *CLI, *self.args], env=self.env, stdout=self._log, stderr=self._log
        )
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no finally, no atexit, no lease release, no report; children (runc, CRIU) live on."""
        assert self.popen is not None
        assert self.popen.poll() is None, f"{self.name} is not running: {self.tail()}"
        os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        assert self.popen.returncode == -signal.SIGKILL

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Rig:
    kube: Kube
    namespace: str
    cluster: LocalCluster
    controller: Service
    agent: Service
    store: Path
    scratch: Path
    runc_root: Path
    marker: str
    watch: InvariantWatch

    def graph(self, replicas: int, state_mib: int) -> Obj:
        env = {
            "PYTHONPATH": str(REPO),
            "WORKER_WEIGHTS_MIB": str(state_mib),
            "WORKER_COMPILE_ROUNDS": "20000",
            # Lets teardown find every worker process this test started, restored ones included.
            "DYNSNAP_KILL_TEST": self.marker,
        }
        return {
            "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
            "kind": "DynamoGraphDeployment",
            "metadata": {"name": GRAPH},
            "spec": {
                "backendFramework": "vllm",
                "services": {
                    SERVICE: {
                        "componentType": "worker",
                        "replicas": replicas,
                        "resources": {"limits": {"gpu": "1"}},
                        "extraPodSpec": {
                            "mainContainer": {
                                "image": "local/cpu-worker:test",
                                "command": [sys.executable, str(WORKER)],
                                "env": [{"name": k, "value": v} for k, v in env.items()],
                            }
                        },
                        "checkpoint": {"enabled": True, "mode": "Auto", "identity": IDENTITY},
                    }
                },
            },
        }

    async def create_graph(self, replicas: int, state_mib: int = 16) -> None:
        self.watch.allow(GRAPH, SERVICE, replicas)
        await DgdClient(self.kube).create(self.graph(replicas, state_mib), self.namespace)

    async def scale(self, replicas: int) -> None:
        self.watch.allow(GRAPH, SERVICE, max(replicas, self.watch.allowed.get((GRAPH, SERVICE), 0)))
        await DgdClient(self.kube).set_replicas(GRAPH, self.namespace, SERVICE, replicas)

    async def workers(self) -> list[Obj]:
        pods, _ = await self.kube.list_all(POD, self.namespace)
        return [p for p in pods if worker_owner(p) is not None and holds_a_replica(p)]

    async def story(self) -> str:
        """The namespace's Events, oldest first: what a failed assertion should be read with."""
        events, _ = await self.kube.list_all(EVENT, self.namespace)
        events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return "\n".join(
            f"{e.get('reason')}: {e['involvedObject'].get('name')}: {e.get('message')}" for e in events
        )

    async def checkpoint(self) -> Obj | None:
        items, _ = await self.kube.list_all(CHECKPOINT, self.namespace)
        return items[0] if items else None

    async def until(self, what: str, check: Callable[[], Awaitable[Any]], within: float) -> Any:
        """Poll ``check`` for progress only (never for an invariant: those are the watch's)."""
        deadline = time.monotonic() + within
        last: Any = None
        while time.monotonic() < deadline:
            for svc in (self.controller, self.agent):
                assert svc.alive(), f"{svc.name} exited while waiting for {what}:\n{svc.tail()}"
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.2)
        raise AssertionError(
            f"{what}: not within {within:.0f}s (last {last!r})\n--- controller\n{self.controller.tail()}"
            f"\n--- agent\n{self.agent.tail()}"
        )

    async def checkpoint_phase(self, *phases: str) -> Obj | None:
        ckpt = await self.checkpoint()
        return ckpt if ckpt is not None and (ckpt.get("status") or {}).get("phase") in phases else None

    async def converged(self, replicas: int) -> list[Obj] | None:
        """``replicas`` worker pods, each running a worker: a cold start the agent launched, or a restore
        it reported completed (restore pods not yet restored, or being replaced, are not there yet)."""
        pods = await self.workers()
        if len(pods) != replicas:
            return None
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            ann = pod["metadata"].get("annotations") or {}
            if labels.get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE:
                if ann.get(RESTORE_STATUS) != "completed":
                    return None
            elif (pod.get("status") or {}).get("phase") != "Running" or not await self.container_pid(pod):
                return None
        return pods

    async def container_pid(self, pod: Obj) -> int | None:
        """The pid (on this host) of the runc container the agent runs for ``pod``."""
        proc = await asyncio.create_subprocess_exec(
            "runc",
            "--root",
            str(self.runc_root),
            "state",
            workload_key(pod),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            return None
        state = json.loads(out)
        return int(state["pid"]) if state.get("status") == "running" else None

    async def settled(self, replicas: int, quiet: float = 3.0) -> list[Obj]:
        """Converged, and still so ``quiet`` seconds later: no late duplicate, no late deletion."""
        await self.until(f"{replicas} workers", lambda: self.converged(replicas), 90)
        await asyncio.sleep(quiet)
        pods = await self.until(f"{replicas} workers, still", lambda: self.converged(replicas), 30)
        dgd_uid = (await DgdClient(self.kube).get(GRAPH, self.namespace))["metadata"]["uid"]
        for pod in pods:
            assert [r["uid"] for r in pod["metadata"].get("ownerReferences") or []] == [dgd_uid]
        return list(pods)

    async def finish(self) -> None:
        """The run's verdict: no invariant broken at any moment, and no staging left by a killed agent
        once its successor runs (store ``.partial-``/``.deleting-``, restore scratch of dead pids)."""
        left = await asyncio.to_thread(leftover_staging, self.store, [self.scratch])
        await self.watch.stop()
        self.watch.assert_clean()
        assert not left, f"staging nobody will finish: {left}"

    async def ready_checkpoint(self) -> Obj:
        ckpt: Obj = await self.until(
            "the checkpoint to be Ready", lambda: self.checkpoint_phase("Ready", "Failed"), 90
        )
        assert ckpt["status"]["phase"] == "Ready", ckpt.get("status")
        return ckpt


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries ``marker``: the workers, restored or not."""
    needle = f"DYNSNAP_KILL_TEST={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                os.kill(int(entry), signal.SIGKILL)


def _remove_containers(runc_root: Path) -> None:
    listing = subprocess.run(
        ["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True, check=False
    )
    for name in listing.stdout.split():
        subprocess.run(
            ["runc", "--root", str(runc_root), "delete", "-f", name], capture_output=True, check=False
        )


@pytest.fixture
async def rig(
    api: client.ApiClient,
    cluster: LocalCluster,
    namespace: str,
    crds: list[str],
    gpu_node: Callable[..., dict[str, Any]],
    criu_bin: Path,
    tmp_path: Path,
) -> AsyncIterator[Rig]:
    node = gpu_node(gpus=16)["metadata"]["name"]
    store, scratch, base = tmp_path / "artifacts", tmp_path / "scratch", tmp_path / "node"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONPATH": str(REPO)}
    agent_config = tmp_path / "agent.yaml"
    # The containers see this interpreter, its virtualenv and the checkout, read-only.
    binds = ["/usr", "/etc", "/opt", sys.prefix, sys.base_prefix, str(REPO)]
    agent_config.write_text(yaml.safe_dump({"hostBinds": binds}))
    agent = Service(
        "agent",
        [
            "agent",
            "--config",
            str(agent_config),
            "--node-name",
            node,
            "--artifact-root",
            str(store),
            "--control-root",
            str(base / "control"),
            "--state-root",
            str(base / "state"),
            "--restore-scratch",
            str(scratch),
            "--runtime",
            "runc",
            "--launch-workloads",
            "--compress-pages",  # one of the moments killed at is the compression of the pages
            "--ready-timeout-seconds",
            "60",
            "--metrics-port",
            "0",
            "--health-port",
            "0",
            "--criu",
            str(criu_bin),
        ],
        env,
        tmp_path / "agent.log",
    )
    controller = Service(
        "controller",
        [
            "controller",
            "--namespace",
            namespace,
            "--no-leader-elect",
            "--resync-seconds",
            "5",
            "--no-autoscale",
            "--metrics-port",
            "0",
            "--health-port",
            "0",
        ],
        env,
        tmp_path / "controller.log",
    )
    kube = Kube(api, field_manager="process-kill-test")
    watch = await InvariantWatch(kube, namespace, store_root=store).start()
    marker = uuid.uuid4().hex
    r = Rig(
        kube, namespace, cluster, controller, agent, store, scratch, base / "state" / "runc", marker, watch
    )
    try:
        yield r
    finally:
        await watch.stop()
        controller.stop()
        agent.stop()
        await asyncio.to_thread(_kill_marked, marker)
        await asyncio.to_thread(_remove_containers, r.runc_root)
        # Nobody runs the controller's finalizers any more; they would keep the namespace Terminating.
        for ckpt in (await kube.list_all(CHECKPOINT, namespace))[0]:
            with contextlib.suppress(ApiError):
                await kube.merge_patch(
                    CHECKPOINT, ckpt["metadata"]["name"], {"metadata": {"finalizers": None}}, namespace
                )


def _restore(pod: Obj) -> bool:
    return (pod["metadata"].get("labels") or {}).get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE


def _staged_images(store: Path, suffix: str) -> bool:
    """A checkpoint's staging directory in the store (``.partial-*/criu``) holds an image file ending in
    ``suffix``: ``.img`` once CRIU is writing, ``.img.dsz`` once the agent compresses the pages."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(store):
            criu = store / name / "criu"
            if name.startswith(".partial-") and not name.endswith(".lock"):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    if any(n.endswith(suffix) for n in os.listdir(criu)):
                        return True
    return False


@pytest.mark.parametrize(
    "moment",
    [
        # CRIU (runc checkpoint) is dumping: it outlives the agent and goes on writing into the staging.
        pytest.param(".img", id="criu-dump"),
        # The dump is done and the agent compresses the pages images, the step before publishing.
        pytest.param(".img" + PACKED_SUFFIX, id="compress-before-publish"),
    ],
)
async def test_agent_killed_mid_checkpoint(rig: Rig, moment: str) -> None:
    """SIGKILL the agent in the middle of a checkpoint: nothing partial is ever visible in the store, and
    the restarted agent removes the staging and takes the capture again (its content had no outcome yet),
    publishing a whole artifact; the graph keeps its cold-started replica meanwhile."""
    rig.controller.start()
    rig.agent.start()
    # Big enough that the dump and the compression of its pages take a few seconds on this machine.
    await rig.create_graph(replicas=1, state_mib=192)
    deadline = time.monotonic() + 90
    while not await asyncio.to_thread(_staged_images, rig.store, moment):
        assert rig.agent.alive(), rig.agent.tail()
        assert time.monotonic() < deadline, f"no staged {moment} file in 90s:\n{rig.agent.tail()}"
        await asyncio.sleep(0.02)
    rig.agent.kill()
    left = leftover_staging(rig.store)
    assert left, "the killed agent's staging should still be there: the kill came too late to test anything"
    assert not list(rig.store.rglob("manifest.json")), "nothing was published before the kill"
    rig.agent.start()
    ckpt: Obj = await rig.until("the checkpoint to end", lambda: rig.checkpoint_phase("Ready", "Failed"), 90)
    assert ckpt["status"]["phase"] == "Ready", ckpt["status"]
    await rig.settled(1)
    await rig.until(
        "the staging to be removed", lambda: asyncio.to_thread(lambda: not leftover_staging(rig.store)), 20
    )
    # One artifact, the one the capture taken again published, whole: every file as its manifest seals it.
    [manifest] = list(rig.store.rglob("manifest.json"))
    key = manifest.parent.relative_to(rig.store).as_posix()
    artifact = await asyncio.to_thread(ArtifactStore(rig.store).open, key)
    assert artifact.manifest.digest == ckpt["status"]["artifactDigest"]
    await asyncio.to_thread(artifact.verify)
    await rig.finish()
    assert rig.watch.peak_workers[(GRAPH, SERVICE)] == 1


async def test_controller_killed_mid_scale_up_by_restore(rig: Rig) -> None:
    """SIGKILL the controller right after its first restore pod of a scale-up 1 -> 6 exists (it creates
    them in doubling batches): the restarted controller creates only the missing ones."""
    rig.controller.start()
    rig.agent.start()
    await rig.create_graph(replicas=1)
    await rig.ready_checkpoint()
    await rig.settled(1, quiet=0.5)

    first_restore = rig.watch.pod_event(
        lambda etype, pod: (
            etype == "ADDED"
            and (pod["metadata"].get("labels") or {}).get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
        )
    )
    await rig.scale(6)
    await asyncio.wait_for(first_restore, 30)
    rig.controller.kill()
    restores = [p for p in await rig.workers() if _restore(p)]
    assert 0 < len(restores) < 5, f"{len(restores)} of 5 restore pods when the controller died"
    await asyncio.sleep(1)  # the apiserver and the agent go on without it
    rig.controller.start()
    pods = await rig.settled(6)
    restored = [
        p for p in pods if p["metadata"]["labels"].get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE
    ]
    assert len(restored) == 5, await rig.story()
    await rig.finish()
    assert rig.watch.peak_workers[(GRAPH, SERVICE)] == 6


async def test_controller_killed_mid_failover(rig: Rig) -> None:
    """Two restored workers' processes die; SIGKILL the controller the moment it has force-deleted the
    first lost pod, before its replacement: the restarted controller sees missing replicas and restores
    them, never more pods than replicas."""
    # The window is the controller's calls from the first deletion to its first replacement; at the lowest
    # CPU priority it is less likely to be over before the test's watch sees that deletion on a busy machine.
    rig.controller.niceness = 19
    rig.controller.start()
    rig.agent.start()
    await rig.create_graph(replicas=1)
    await rig.ready_checkpoint()
    await rig.scale(3)
    pods = await rig.settled(3, quiet=0.5)
    victims = [p for p in pods if p["metadata"]["labels"].get(protocol.LABEL_RESTORE_TARGET) == protocol.TRUE]
    assert len(victims) == 2
    names = {p["metadata"]["name"] for p in victims}
    first_gone = rig.watch.pod_event(
        lambda etype, pod: (
            pod["metadata"]["name"] in names
            and (etype == "DELETED" or bool(pod["metadata"].get("deletionTimestamp")))
        )
    )
    for pod in victims:
        pid = await rig.container_pid(pod)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    await asyncio.wait_for(first_gone, 30)
    rig.controller.kill()
    at_kill = len(await rig.workers())
    assert at_kill < 3, f"{at_kill} workers when the controller died: both replacements were made already"
    await asyncio.sleep(1)
    rig.controller.start()
    final = await rig.settled(3)
    assert not names & {p["metadata"]["name"] for p in final}
    await rig.finish()
    # The surge is for a swapped restore pod; a lost worker is removed before its replacement is made.
    assert rig.watch.peak_workers[(GRAPH, SERVICE)] == 3


def _scratch_in_use(scratch: Path) -> bool:
    """A restore is unpacking pages into the scratch (``<agent pid>-<workload>-<id>/``)."""
    with contextlib.suppress(FileNotFoundError):
        return any(n.split("-", 1)[0].isdigit() for n in os.listdir(scratch))
    return False


async def test_agent_killed_mid_restore(rig: Rig) -> None:
    """SIGKILL the agent while restores of a scale-up unpack their pages into the restore scratch: the
    restarted agent restores those pods again, and the dead agent's scratch directories are removed."""
    rig.controller.start()
    rig.agent.start()
    await rig.create_graph(replicas=1, state_mib=96)
    await rig.ready_checkpoint()
    await rig.scale(3)
    deadline = time.monotonic() + 60
    while not await asyncio.to_thread(_scratch_in_use, rig.scratch):
        assert rig.agent.alive(), rig.agent.tail()
        assert time.monotonic() < deadline, f"no restore unpacked pages in 60s:\n{rig.agent.tail()}"
        await asyncio.sleep(0.02)
    rig.agent.kill()
    assert leftover_staging(rig.store, [rig.scratch]), "the kill came too late: no restore was under way"
    rig.agent.start()
    pods = await rig.settled(3)
    assert len([p for p in pods if _restore(p)]) == 2, await rig.story()
    await rig.finish()
    assert rig.watch.peak_workers[(GRAPH, SERVICE)] == 3


async def test_invariant_watch_sees_violations(
    api: client.ApiClient, namespace: str, crds: list[str], tmp_path: Path
) -> None:
    """The watch is not vacuous: a second checkpoint of one identity, a pod beyond replicas plus the surge
    and an artifact directory without its manifest are each recorded as they appear."""
    kube = Kube(api, field_manager="process-kill-test")
    watch = await InvariantWatch(kube, namespace, store_root=tmp_path).start()
    try:
        watch.allow("g", "s", 1)
        for i in range(1 + 1 + WORKER_SURGE):
            await kube.create(
                POD,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"w{i}",
                        "labels": {protocol.LABEL_GRAPH: "g", protocol.LABEL_SERVICE: "s"},
                    },
                    # No node fits: it stays Pending (unbound, so it goes at once with the namespace),
                    # and a Pending pod holds a replica.
                    "spec": {
                        "nodeSelector": {"process-kill-test": "no-such-node"},
                        "containers": [{"name": "main", "image": "x"}],
                    },
                },
                namespace,
            )
        for name in ("a", "b"):
            await kube.create(
                CHECKPOINT,
                {
                    "apiVersion": f"{protocol.API_GROUP}/{protocol.API_VERSION}",
                    "kind": "DynamoCheckpoint",
                    "metadata": {"name": name, "labels": {protocol.LABEL_CHECKPOINT_HASH: HASH}},
                    "spec": {"identity": IDENTITY, "job": {"podTemplateSpec": {"spec": {"containers": []}}}},
                },
                namespace,
            )
        (tmp_path / namespace / "0b5a1c52-0000-4000-8000-000000000001").mkdir(parents=True)
        for _ in range(200):  # 10 s for the watch to see all three
            if len(watch.violations) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        await watch.stop()
    seen = "\n".join(watch.violations)
    assert "3 worker pods of g/s with 1 replicas" in seen, seen
    assert f"2 DynamoCheckpoints for identity hash {HASH}" in seen, seen
    assert "partial artifact visible" in seen, seen
    with pytest.raises(AssertionError):
        watch.assert_clean()
    for name in ("a", "b"):  # no finalizers on these: the namespace goes with them
        with contextlib.suppress(ApiError):
            await kube.delete(CHECKPOINT, name, namespace)
