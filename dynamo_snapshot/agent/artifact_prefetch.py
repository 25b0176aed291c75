"""Prefetch policy ``all``: every node brings each checkpoint from the object store into its own store as
soon as the PodSnapshot is Ready, so the first restore of it on any node reads local disk.

What is fetched is only what a restore would be granted: a Ready PodSnapshot, bound to a content of its own
namespace that records the artifact's digest (``authorize.ready_artifact``), under the key
``<namespace>/<PodSnapshot uid>``; the bytes are checked against that digest's manifest as they arrive.
Nothing is restored or run here. Every Ready checkpoint is kept on every node until its PodSnapshot is
deleted: the policy is for clusters whose nodes' disks hold them all."""

from __future__ import annotations

import logging

from dynamo_snapshot.agent.authorize import Refused, ready_artifact
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.api.conditions import READY
from dynamo_snapshot.api.views import PodSnapshotContentView, PodSnapshotView
from dynamo_snapshot.kube import DELETED, Kube, Obj
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT_CONTENT
from dynamo_snapshot.kube.until_written import get_or_none

__all__ = ["ArtifactPrefetch"]

log = logging.getLogger(__name__)


class ArtifactPrefetch:
    def __init__(self, kube: Kube, executor: Executor) -> None:
        self.kube = kube
        self.executor = executor

    async def on_snapshot(self, etype: str, snapshot: Obj, old: Obj | None) -> None:
        view = PodSnapshotView(snapshot)
        if etype == DELETED or not view.condition_true(READY):
            return
        if old is not None and PodSnapshotView(old).condition_true(READY):
            return  # fetched (or tried) when it became Ready
        bound = view.bound_content
        content = await get_or_none(self.kube, POD_SNAPSHOT_CONTENT, bound, "") if bound else None
        try:
            key, digest = ready_artifact(
                view, PodSnapshotContentView(content) if content is not None else None, view.meta.namespace
            )
        except Refused as e:
            log.debug("not prefetched", extra={"snapshot": view.meta.name, "why": str(e)})
            return
        self.executor.fetch_ahead(key, digest)
