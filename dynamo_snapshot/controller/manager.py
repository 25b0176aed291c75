"""The controller process: informers feed one work queue (one reconcile per object at a time, different
objects in parallel), leader election guards writes, SIGTERM drains in-flight reconciles.

What runs and what wakes it are the layers' tables (controller.watch): the generic layer's, then the
Dynamo layer's on it."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass

from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.controller.context import Context
from dynamo_snapshot.controller.dynamo import watches as dynamo_layer
from dynamo_snapshot.controller.dynamo.operator_failover import OperatorFailover
from dynamo_snapshot.controller.snapshot import watches as snapshot_layer
from dynamo_snapshot.controller.watch import QueueKey, Reconciler, Watch
from dynamo_snapshot.kube import (
    Informer,
    Kube,
    LeaderElector,
    Obj,
    Result,
    WorkQueue,
)
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot.kube.kinds import DGD

# ControllerConfig lives in controller.config (Context reads it too); callers keep importing it from here.
__all__ = ["Controller", "ControllerConfig"]

log = logging.getLogger(__name__)

RECONCILERS = (*snapshot_layer.RECONCILERS, *dynamo_layer.RECONCILERS)
WATCHES = (*snapshot_layer.WATCHES, *dynamo_layer.WATCHES)
# Work that runs only while this replica leads, given the process's `stop`: started once the caches are
# synced, cancelled when `stop` is set or leadership is lost.
LeaderTask = Callable[[asyncio.Event], Coroutine[object, object, None]]


@dataclass(frozen=True)
class _LeaderOnly:
    name: str
    run: LeaderTask


class Controller:
    def __init__(
        self,
        kube: Kube,
        config: ControllerConfig,
        *,
        left_to_others: frozenset[str] = frozenset(),
        dgd_version: DgdVersion | None = None,
    ) -> None:
        self.kube = kube
        self.config = config
        # The version DGDs are read and written at: v1beta1 where served (install_mode.check_install_mode).
        self.dgd_version = dgd_version or DgdVersion()
        # Kinds whose objects another operator runs (install_mode.kinds_left_to_others): never reconciled.
        self.left_to_others = left_to_others
        self.ctx = Context.for_controller(kube, config, self.dgd_version)
        # Reconciled kind -> its reconciler, for the kinds this install mode runs.
        self.reconcilers: dict[str, Reconciler] = {
            r.kind: r.new(self.ctx) for r in RECONCILERS if r.runs(config)
        }
        self._leader_only: list[_LeaderOnly] = []
        self._extra_informers: list[Informer] = []
        self.queue: WorkQueue[QueueKey] = WorkQueue(
            "controller", self._reconcile, workers=config.workers, kind_of=lambda k: k[0]
        )
        self.ctx.failover.wake = lambda dgd_key, delay: self.queue.add_after((DGD.kind, dgd_key), delay)
        # None without leader election: then this replica leads from the start.
        self.elector: LeaderElector | None = (
            LeaderElector(kube, name=config.lease_name, namespace=config.lease_namespace)
            if config.leader_elect
            else None
        )
        for watch in WATCHES:
            self._wire(watch)
        self.operator_failover = None if config.runs_dgds else self._operator_failover()

    def _operator_failover(self) -> OperatorFailover:
        """Mode dynamo-operator: the operator's lost workers of checkpointed components are deleted (while
        this replica leads) so that their owners create restore pods in their place."""
        failover = OperatorFailover(self.ctx)
        self.run_while_leading("operator-failover", failover.run_until, informers=[self.ctx.component_pods])
        return failover

    def run_while_leading(self, name: str, task: LeaderTask, *, informers: Iterable[Informer] = ()) -> None:
        """Run `task` whenever this replica leads, once every informer (these too) has synced.

        `informers` are started and stopped with the controller's own and count in its readiness. Call
        before `run_until`."""
        self._leader_only.append(_LeaderOnly(name, task))
        self._extra_informers.extend(informers)

    @property
    def leading(self) -> bool:
        """Whether this replica does the work: always without leader election, else while it holds the
        Lease."""
        return self.elector is None or self.elector.is_leader

    def readiness(self) -> str | None:
        """None when ready: a standby replica is (it can take over), the leader once its caches are synced.

        A standby must count as ready, or a rolling update of a leader-elected Deployment would wait forever
        for a new pod that cannot lead while the old one holds the Lease.
        """
        if not self.leading:
            return None
        waiting = [inf.kind.kind for inf in self.informers if not inf.has_synced.is_set()]
        return f"leading; informer caches not synced yet: {', '.join(waiting)}" if waiting else None

    @property
    def informers(self) -> list[Informer]:
        c = self.ctx
        generic = [c.contents, c.snapshots, c.snapshot_jobs]
        dgds = [c.dgds] if self.config.runs_dgds else []
        return [c.nodes, c.jobs, c.pods, *generic, c.checkpoints, *dgds, *self._extra_informers]

    def _wire(self, watch: Watch) -> None:
        ctx, kind = self.ctx, watch.kind

        async def handler(etype: str, obj: Obj, old: Obj | None) -> None:
            for key in watch.keys(ctx, etype, obj, old):
                self.queue.add((kind, key))

        watch.cache(ctx).add_handler(handler)

    async def _reconcile(self, key: QueueKey) -> Result | None:
        kind, obj_key = key
        reconciler = self.reconcilers.get(kind)
        # A worker pod or node event may name a DGD in either mode; only standalone reconciles it.
        if kind in self.left_to_others or reconciler is None:
            return None
        return await reconciler.reconcile(obj_key)

    async def run_until(self, stop: asyncio.Event) -> None:
        """Run (as leader, when leader election is on) until `stop` is set, then drain and return."""
        if self.elector is None:
            await self._lead(stop)
            return
        leading = asyncio.create_task(self.elector.run(lambda: self._lead(stop)))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({leading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not leading.done():
            leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
        stopped.cancel()

    async def _lead(self, stop: asyncio.Event) -> None:
        ctx = self.ctx
        leader_only: list[asyncio.Task[None]] = []
        for inf in self.informers:
            inf.start()
        try:
            await asyncio.gather(*(inf.wait_synced() for inf in self.informers))
            log.info(
                "caches synced",
                extra={"mode": str(self.config.mode), "dgds": len(ctx.dgds), "pods": len(ctx.pods)},
            )
            # The caches are long-lived: keep the cyclic GC from re-scanning them (0.5 s stalls at 10k pods).
            gc.freeze()
            self.queue.start()
            self.queue.resync(self._all_keys, self.config.resync_seconds)
            leader_only = [asyncio.create_task(t.run(stop), name=t.name) for t in self._leader_only]
            await stop.wait()
        finally:
            # Ended here on `stop` and on lost leadership alike; only reconciles get the drain below.
            for task in leader_only:
                task.cancel()
            await asyncio.gather(*leader_only, return_exceptions=True)
            # In-flight reconciles finish their writes; nothing new starts.
            await asyncio.shield(self.queue.shutdown(self.config.drain_timeout))
            for inf in self.informers:
                await inf.stop()
            await ctx.recorder.close()

    def _all_keys(self) -> list[QueueKey]:
        # Informer.keys() is a method returning the cache keys, not a dict view.
        return [(r.kind, k) for r in RECONCILERS for k in r.cache(self.ctx).keys()]  # noqa: SIM118
