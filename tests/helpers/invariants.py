"""Safety invariants checked over a whole test run, not only at its end.

A background watch (pods and DynamoCheckpoints of one namespace) and a poller of the artifact store record a
violation the moment it is visible; the test calls ``assert_clean`` at its end. Never assert these inside a
retrying poller (``eventually``): it would take a violation for "not converged yet" and retry it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact.manifest import MANIFEST_NAME, Manifest
from dynamo_snapshot.artifact.store import DELETING_PREFIX, PARTIAL_PREFIX
from dynamo_snapshot.kube import POD, ApiError, Kube, Obj, ResourceKind, is_gone
from dynamo_snapshot.kube.kinds import CHECKPOINT

# Worker pods a service may have beyond its replicas at any moment. The controller replaces a failed or
# unschedulable restore pod by creating the replacement *before* deleting the pod ("the replacement exists
# before the pod goes, so the replica is never missing from the count": DgdReconciler._swap_restore), so
# one swap holds one extra pod for an instant. Lost workers are force-deleted before their replacement is
# created (docs/architecture.md, Failover), scale-ups and scale-downs never overshoot.
WORKER_SURGE = 1


def worker_owner(pod: Obj) -> tuple[str, str] | None:
    """(graph, service) of a DGD's worker pod; None for anything else (a SnapshotJob's pod, such as the
    one a checkpoint is taken from)."""
    labels = pod["metadata"].get("labels") or {}
    if labels.get(protocol.LABEL_SNAPSHOT_JOB):
        return None
    graph, service = labels.get(protocol.LABEL_GRAPH), labels.get(protocol.LABEL_SERVICE)
    return (graph, service) if graph and service else None


def holds_a_replica(pod: Obj) -> bool:
    """Counted against the service's replicas: not being deleted and not finished."""
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


@dataclass
class InvariantWatch:
    """Watches one namespace (and optionally an artifact store) and records every invariant broken.

    ``allow(graph, service, replicas)`` sets the most replicas the test asked for; call it *before* the
    scale-up that needs it (and after a scale-down has converged), so no watch lag reads as a violation.
    """

    kube: Kube
    namespace: str
    store_root: Path | None = None
    store_every: float = 0.02
    violations: list[str] = field(default_factory=list)
    allowed: dict[tuple[str, str], int] = field(default_factory=dict)
    pods: dict[str, Obj] = field(default_factory=dict)
    checkpoints: dict[str, Obj] = field(default_factory=dict)
    peak_workers: Counter[tuple[str, str]] = field(default_factory=Counter)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _started: float = field(default_factory=time.monotonic)
    _synced: dict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))
    _reported: set[str] = field(default_factory=set)
    _waiters: list[tuple[Callable[[str, Obj], bool], asyncio.Future[Obj]]] = field(default_factory=list)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> InvariantWatch:
        self._tasks.append(asyncio.create_task(self._watch(POD, self.pods, self._check_pods), name="pods"))
        self._tasks.append(
            asyncio.create_task(
                self._watch(CHECKPOINT, self.checkpoints, self._check_checkpoints), name="checkpoints"
            )
        )
        if self.store_root is not None:
            self._tasks.append(asyncio.create_task(self._poll_store(), name="store"))
        for kind in (POD, CHECKPOINT):
            await asyncio.wait_for(self._synced[kind.plural].wait(), 30)
        return self

    async def stop(self) -> None:
        self._note_dead_watchers()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def pod_event(self, match: Callable[[str, Obj], bool]) -> asyncio.Future[Obj]:
        """The first pod watch event ``(type, pod)`` that ``match`` accepts from now on, resolved in the
        watch's own step: a test that kills a process on it acts within one event-loop turn."""
        fut: asyncio.Future[Obj] = asyncio.get_running_loop().create_future()
        self._waiters.append((match, fut))
        return fut

    def _wake(self, etype: str, pod: Obj) -> None:
        for entry in list(self._waiters):
            match, fut = entry
            if fut.done():
                self._waiters.remove(entry)
            elif match(etype, pod):
                fut.set_result(pod)
                self._waiters.remove(entry)

    async def __aenter__(self) -> InvariantWatch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def allow(self, graph: str, service: str, replicas: int) -> None:
        self.allowed[(graph, service)] = replicas

    def assert_clean(self) -> None:
        """Fail with every violation seen (and if a watcher died, which would have hidden some)."""
        self._note_dead_watchers()
        assert not self.violations, "invariants broken during the run:\n  " + "\n  ".join(self.violations)

    def _note_dead_watchers(self) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._record(f"the {task.get_name()} watcher died: {task.exception()!r}")

    def _record(self, what: str) -> None:
        # Once each: every later event of the same pods (status updates) would repeat it.
        if what not in self._reported:
            self._reported.add(what)
            self.violations.append(f"t+{time.monotonic() - self._started:.2f}s: {what}")

    # ------------------------------------------------------------------ the apiserver
    async def _watch(self, kind: ResourceKind, seen: dict[str, Obj], check: Callable[[], None]) -> None:
        """List, then watch from the list's resourceVersion and on from the last event's, so that one
        resourceVersion-ordered stream of the namespace is seen without a gap; only an expired
        resourceVersion (410) lists again."""
        rv = ""
        while True:
            if not rv:
                items, rv = await self.kube.list_all(kind, self.namespace)
                seen.clear()
                seen.update({o["metadata"]["name"]: o for o in items})
                check()
                self._synced[kind.plural].set()
            try:
                async with contextlib.aclosing(
                    self.kube.watch(kind, self.namespace, resource_version=rv, timeout_seconds=60)
                ) as events:
                    async for etype, obj in events:
                        rv = obj["metadata"].get("resourceVersion") or rv
                        if etype == "BOOKMARK":
                            continue
                        name = obj["metadata"]["name"]
                        if etype == "DELETED":
                            seen.pop(name, None)
                        else:
                            seen[name] = obj
                        check()
                        if kind is POD:
                            self._wake(etype, obj)
            except (ApiError, TimeoutError, OSError) as e:
                if is_gone(e):
                    rv = ""  # compacted away: only a list can say where things are now
                await asyncio.sleep(0.2)

    def _check_pods(self) -> None:
        counts: Counter[tuple[str, str]] = Counter()
        for pod in self.pods.values():
            owner = worker_owner(pod)
            if owner is not None and holds_a_replica(pod):
                counts[owner] += 1
        for owner, n in counts.items():
            self.peak_workers[owner] = max(self.peak_workers[owner], n)
            limit = self.allowed.get(owner)
            if limit is not None and n > limit + WORKER_SURGE:
                names = sorted(
                    p["metadata"]["name"]
                    for p in self.pods.values()
                    if worker_owner(p) == owner and holds_a_replica(p)
                )
                self._record(
                    f"{n} worker pods of {owner[0]}/{owner[1]} with {limit} replicas "
                    f"(surge {WORKER_SURGE}): {names}"
                )

    def _check_checkpoints(self) -> None:
        by_hash: defaultdict[str, list[str]] = defaultdict(list)
        for name, ckpt in self.checkpoints.items():
            h = (ckpt["metadata"].get("labels") or {}).get(protocol.LABEL_CHECKPOINT_HASH)
            if h:
                by_hash[h].append(name)
        for h, names in by_hash.items():
            if len(names) > 1:
                self._record(f"{len(names)} DynamoCheckpoints for identity hash {h}: {sorted(names)}")

    # ------------------------------------------------------------------ the artifact store
    async def _poll_store(self) -> None:
        assert self.store_root is not None
        while True:
            for problem in await asyncio.to_thread(store_problems, self.store_root, self.namespace):
                self._record(problem)
            await asyncio.sleep(self.store_every)


def _manifest_of(directory: Path) -> Manifest | None:
    """The artifact's manifest; None while there is none (or it vanished: deleted meanwhile)."""
    try:
        data = (directory / MANIFEST_NAME).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Manifest.from_json(data, source=str(directory / MANIFEST_NAME))


def store_problems(root: Path, namespace: str) -> list[str]:
    """What a reader of ``namespace``'s artifacts must never see in the store: an artifact directory
    without its complete manifest, or two artifacts of one identity."""
    ns_dir = root / namespace
    try:
        uids = os.listdir(ns_dir)
    except FileNotFoundError:
        return []
    problems: list[str] = []
    by_hash: defaultdict[str, list[str]] = defaultdict(list)
    for uid in uids:
        directory = ns_dir / uid
        try:
            manifest = _manifest_of(directory)
        except Exception as e:  # a torn or half-written manifest.json is as bad as none
            problems.append(f"artifact {namespace}/{uid} has an unreadable manifest: {e}")
            continue
        if manifest is None:
            if directory.exists():  # not deleted between the listing and the read
                problems.append(f"partial artifact visible: {namespace}/{uid} has no {MANIFEST_NAME}")
            continue
        by_hash[manifest.identity_hash].append(uid)
    for h, keys in by_hash.items():
        if len(keys) > 1:
            problems.append(f"{len(keys)} artifacts for identity hash {h}: {sorted(keys)}")
    return problems


def leftover_staging(store_root: Path, scratch_roots: Iterable[Path] = ()) -> list[str]:
    """Staging nobody will finish: the store's ``.partial-``/``.deleting-`` entries, and restore scratch
    directories (``<agent pid>-<key>-<id>``) of agent processes that no longer run."""
    found: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        found += [
            str(store_root / n)
            for n in os.listdir(store_root)
            if n.startswith((PARTIAL_PREFIX, DELETING_PREFIX))
        ]
    for base in scratch_roots:
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(base):
                owner = n.split("-", 1)[0]
                if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                    found.append(str(base / n))
    return found
