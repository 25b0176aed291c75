"""Artifacts of deleted PodSnapshots removed from this node's store and cache: when the deletion is seen,
after the first sync (deletions while no agent watched), and now and then (events missed).

An artifact stored under ``<namespace>/<uid>`` belongs to the PodSnapshot with that UID (the owners'
informer); it lives as long as that PodSnapshot does. A DynamoCheckpoint's artifact is its PodSnapshot's
(the checkpoint controls the PodSnapshot, so the garbage collector deletes the PodSnapshot with it).
DynamoCheckpoints are no owners: no capture stores under a DynamoCheckpoint's UID, and no restore reads
such a key (a restore from a DynamoCheckpoint reads the PodSnapshot it records), so an artifact an older
agent stored under one is unreachable and is removed like any other key without an owner."""

from __future__ import annotations

import asyncio
import logging

from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.api.views import Meta
from dynamo_snapshot.artifact import ArtifactStore, artifact_key, validate_artifact_key
from dynamo_snapshot.artifact.store import is_bound_key
from dynamo_snapshot.kube import DELETED, Informer, Obj

log = logging.getLogger(__name__)

__all__ = ["REMOVE_RETRY_S", "SWEEP_EVERY_S", "ArtifactSweeper"]

# How often an artifact whose owner is gone is tried again while a restore on this node reads it, and
# how often the store is swept for artifacts of owners deleted while no agent watched.
REMOVE_RETRY_S, SWEEP_EVERY_S = 5.0, 600.0


class ArtifactSweeper:
    def __init__(self, executor: Executor, owners: list[Informer]) -> None:
        self.executor = executor
        self.owners = owners
        self._removing: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def on_owner(self, etype: str, owner: Obj, old: Obj | None) -> None:
        if etype == DELETED:
            meta = Meta(owner)
            self.remove_soon(artifact_key(meta.namespace, meta.uid))

    async def sweep_forever(self) -> None:
        """Remove the artifacts whose owner no longer exists: after the first sync (owners
        deleted while no agent ran), then now and then (deletions whose event was missed)."""
        for owners in self.owners:
            await owners.wait_synced()
        while True:
            live = {
                artifact_key(Meta(c).namespace, Meta(c).uid) for owners in self.owners for c in owners.list()
            }
            for key in await asyncio.to_thread(self._namespaced_keys):
                if key not in live:
                    self.remove_soon(key)
            await asyncio.sleep(SWEEP_EVERY_S)

    def _stores(self) -> list[ArtifactStore]:
        return [self.executor.store] + ([self.executor.cache.store] if self.executor.cache else [])

    def _namespaced_keys(self) -> set[str]:
        # Keys of the `<namespace>/<uid>` form belong to owners; bare hashes are CLI artifacts.
        return {key for store in self._stores() for key in store.list() if is_bound_key(key)}

    def _holds(self, key: str) -> bool:
        return any(store.exists(key) for store in self._stores())

    def remove_soon(self, key: str) -> None:
        if key in self._removing:
            return
        self._removing.add(key)
        task = asyncio.create_task(self._remove_artifact(key), name=f"remove-{key}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _remove_artifact(self, key: str) -> None:
        """Delete `key`'s artifact from the store and the node cache, waiting while a restore reads it."""
        try:
            validate_artifact_key(key)
            if not await asyncio.to_thread(self._holds, key):
                return  # most deleted owners left nothing in this node's store
            # Nothing signals the end of a restore that reads it: look again now and then.
            while not await self.executor.delete_artifact(key):  # noqa: ASYNC110
                await asyncio.sleep(REMOVE_RETRY_S)
            log.info("removed the artifact of a deleted owner", extra={"key": key})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not remove the artifact of a deleted owner", extra={"key": key})
        finally:
            self._removing.discard(key)
