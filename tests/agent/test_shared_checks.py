"""Restores of one artifact that check its files at the same time share one check (Node.shared_check): a
burst of restores reads and hashes the weights, and the process images, once. Each waiter still gets the
verdict, a waiter that gives up does not end the check for the others, and a check that ended is not
reused. A check begun ahead of a restore (while the kubelet starts its pod's container) is the one the
restore joins."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.errors import ArtifactRefused
from dynamo_snapshot.agent.node import Node
from dynamo_snapshot.agent.restore import Greeting, RestoreRun, check_ahead
from dynamo_snapshot.agent.timings import Timings
from dynamo_snapshot.artifact import ArtifactError
from dynamo_snapshot.fileio import TreeStats

FILES = ["weights/00-model.dsw"]


class _Artifact:
    """The two things a weights check uses of an artifact; `averify` counts its calls and waits for `go`."""

    def __init__(self, path: Path, *, fail: bool = False) -> None:
        self.path = path
        self.key = "0123456789abcdef"
        self.calls = 0
        self.go = asyncio.Event()
        self.fail = fail

    async def averify(self, **kwargs: Any) -> TreeStats:
        self.calls += 1
        await self.go.wait()
        if self.fail:
            raise ArtifactError("checksum mismatch: weights/00-model.dsw")
        return TreeStats(4096, 0.5)


class _Node(SimpleNamespace):
    """What a weights check uses of a Node, with the Node's own sharing of checks."""

    shared_check = Node.shared_check


def _node() -> _Node:
    return _Node(
        checks={},
        verified=None,
        config=AgentConfig(node_name="n"),
    )


def _run(node: _Node, artifact: _Artifact, key: str) -> RestoreRun:
    return RestoreRun(node, key, artifact, Timings(), Greeting({}, None), None, None)  # type: ignore[arg-type]


async def test_concurrent_restores_share_one_check(tmp_path: Path) -> None:
    node, artifact = _node(), _Artifact(tmp_path)
    waiters = [asyncio.create_task(_run(node, artifact, f"r{i}").verify_weights(FILES)) for i in range(4)]
    await asyncio.sleep(0.05)
    artifact.go.set()
    results = await asyncio.gather(*waiters)
    assert artifact.calls == 1
    # The restore that started the check counts its bytes; the ones that joined it count none.
    assert sorted(r.bytes for r in results) == [0, 0, 0, 4096]
    assert node.checks == {}
    # Ended: the next restore checks again.
    await _run(node, artifact, "later").verify_weights(FILES)
    assert artifact.calls == 2


async def test_a_cancelled_restore_leaves_the_check_to_the_others(tmp_path: Path) -> None:
    node, artifact = _node(), _Artifact(tmp_path)
    first = asyncio.create_task(_run(node, artifact, "first").verify_weights(FILES))
    second = asyncio.create_task(_run(node, artifact, "second").verify_weights(FILES))
    await asyncio.sleep(0.05)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    artifact.go.set()
    assert (await second).bytes == 0  # it joined the first one's check, which ran on without it
    assert artifact.calls == 1
    assert node.checks == {}


async def test_every_waiter_gets_a_failed_check(tmp_path: Path) -> None:
    node, artifact = _node(), _Artifact(tmp_path, fail=True)
    waiters = [asyncio.create_task(_run(node, artifact, f"r{i}").verify_weights(FILES)) for i in range(3)]
    await asyncio.sleep(0.05)
    artifact.go.set()
    for outcome in await asyncio.gather(*waiters, return_exceptions=True):
        assert isinstance(outcome, ArtifactRefused)
        assert "weights of artifact 0123456789abcdef refused: checksum mismatch" in str(outcome)
    assert artifact.calls == 1


async def test_other_files_or_artifacts_are_checked_apart(tmp_path: Path) -> None:
    node = _node()
    one, other = _Artifact(tmp_path / "a"), _Artifact(tmp_path / "b")
    tasks = [
        asyncio.create_task(_run(node, one, "r1").verify_weights(FILES)),
        asyncio.create_task(_run(node, one, "r2").verify_weights(["weights/01-other.dsw"])),
        asyncio.create_task(_run(node, other, "r3").verify_weights(FILES)),
    ]
    await asyncio.sleep(0.05)
    one.go.set()
    other.go.set()
    await asyncio.gather(*tasks)
    assert (one.calls, other.calls) == (2, 1)


async def test_concurrent_restores_share_one_check_of_the_process_images(tmp_path: Path) -> None:
    node, artifact = _node(), _Artifact(tmp_path)
    artifact.manifest = SimpleNamespace(  # type: ignore[attr-defined]
        files=[SimpleNamespace(path="criu/pstree.img"), SimpleNamespace(path="criu/pages-1.img")]
    )
    runs = [_run(node, artifact, f"r{i}") for i in range(3)]
    waiters = [asyncio.create_task(r.verify_process_images()) for r in runs]
    await asyncio.sleep(0.05)
    artifact.go.set()
    await asyncio.gather(*waiters)
    assert artifact.calls == 1
    assert sorted(r.verified_bytes for r in runs) == [0, 0, 4096]


def _with_images(artifact: _Artifact) -> _Artifact:
    artifact.manifest = SimpleNamespace(  # type: ignore[attr-defined]
        files=[SimpleNamespace(path="criu/pstree.img"), SimpleNamespace(path="criu/pages-1.img")], extra={}
    )
    return artifact


async def test_the_restore_joins_the_check_begun_ahead_of_it(tmp_path: Path) -> None:
    node, artifact = _node(), _with_images(_Artifact(tmp_path))
    ahead = asyncio.create_task(check_ahead(node, artifact))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    run = _run(node, artifact, "r1")
    restore = asyncio.create_task(run.verify_process_images())
    await asyncio.sleep(0.05)
    artifact.go.set()
    assert (await ahead).bytes == 4096  # counted once, by the check that read them
    await restore
    assert (artifact.calls, run.verified_bytes) == (1, 0)


async def test_a_failed_check_ahead_is_the_restores_refusal_too(tmp_path: Path) -> None:
    node, artifact = _node(), _with_images(_Artifact(tmp_path, fail=True))
    ahead = asyncio.create_task(check_ahead(node, artifact))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    restore = asyncio.create_task(_run(node, artifact, "r1").verify_process_images())
    await asyncio.sleep(0.05)
    artifact.go.set()
    outcome = await asyncio.gather(ahead, restore, return_exceptions=True)
    assert isinstance(outcome[0], ArtifactError)
    assert isinstance(outcome[1], ArtifactRefused)
    assert "checksum mismatch" in str(outcome[1])
    # Ended with its verdict: a restore that comes later checks again and is refused by its own check.
    with pytest.raises(ArtifactRefused):
        await _run(node, artifact, "r2").verify_process_images()
    assert artifact.calls == 2
