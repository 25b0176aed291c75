"""A restore into a kubelet's pod checks the artifact while the kubelet starts the pod's container
(Executor.check_ahead): the check reads and hashes the process images once, the restore then finds them
verified; an artifact that is not the one recorded is left for the restore to refuse; the agent's
shutdown stops checks still under way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.runtime.base import Runtime
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.criu import Criu
from tests.artifact.helpers import HASH, publish, sample_files


class _Untouchable:
    name = "process"

    def __getattr__(self, attr: str) -> Any:
        raise AssertionError(f"{attr} used by a check of the artifact alone")


async def _executor(tmp_path: Path) -> tuple[Executor, str]:
    store = ArtifactStore(tmp_path / "store")
    await publish(store, sample_files())
    runtime, criu = cast(Runtime, _Untouchable()), cast(Criu, _Untouchable())
    executor = Executor(runtime, store, criu, AgentConfig(node_name="node-a"), cuda=None, gpus=None)
    return executor, store.open(HASH).manifest.digest or ""


def _verified(executor: Executor) -> list[bool]:
    artifact = executor.store.open(HASH)
    assert executor.verified is not None
    return [executor.verified.known(artifact.path, entry) for entry in artifact.manifest.files]


async def _checked(executor: Executor) -> None:
    await asyncio.gather(*executor.checks_ahead)


async def test_the_check_ahead_verifies_every_process_image(tmp_path: Path) -> None:
    executor, digest = await _executor(tmp_path)
    assert not any(_verified(executor))
    executor.check_ahead(HASH, digest)
    await _checked(executor)
    assert all(_verified(executor))
    assert executor.reading == {}  # a deletion is no longer held back


async def test_an_artifact_not_the_recorded_one_is_left_unchecked(tmp_path: Path) -> None:
    executor, _ = await _executor(tmp_path)
    executor.check_ahead(HASH, "sha256:" + "0" * 64)
    executor.check_ahead("no-such-artifact", None)
    await _checked(executor)
    assert not any(_verified(executor))


async def test_shutdown_stops_the_checks_under_way(tmp_path: Path) -> None:
    executor, digest = await _executor(tmp_path)
    executor.check_ahead(HASH, digest)
    assert executor.checks_ahead
    await executor.aclose()
    assert not executor.checks_ahead
