"""One node of the Executor tests: the host-process runtime and real CRIU, no GPU, the store under the
test's own directory, and a worker checkpointed into it."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any, TypeVar

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import CheckpointOutcome, Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec
from dynamo_snapshot.agent.runtime.base import Workload
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore, Binding
from dynamo_snapshot.criu import Criu
from tests.helpers.polling import await_json

REPO = Path(__file__).resolve().parents[2]
NODE = "node-a"
E = TypeVar("E", bound=Executor)
R = TypeVar("R", bound=ProcessRuntime)


def local_executor(
    tmp: Path,
    criu_bin: Path,
    *,
    cache: ArtifactCache | None = None,
    objects: ObjectStore | None = None,
    kind: type[E] = Executor,  # type: ignore[assignment]
    runtime_kind: type[R] = ProcessRuntime,  # type: ignore[assignment]
    **settings: Any,
) -> tuple[E, R]:
    """An Executor (``kind``) on ``tmp/node-a`` (control dirs) over the store ``tmp/store``; ``settings``
    are the agent's, by name (the restore scratch defaults to ``tmp/scratch``)."""
    criu = Criu(criu_bin)
    runtime = runtime_kind(tmp / NODE, criu)
    settings.setdefault("restore_scratch", tmp / "scratch")
    config = AgentConfig.model_validate({"node_name": NODE, "runtime": "local", **settings})
    executor = kind(
        runtime,
        ArtifactStore(tmp / "store"),
        criu,
        config,
        cuda=None,
        gpus=None,
        cache=cache,
        objects=objects,
    )
    return executor, runtime


def node_with_cache(
    tmp: Path, criu_bin: Path, objects: ObjectStore, max_bytes: int = 1 << 30, **settings: Any
) -> tuple[Executor, ProcessRuntime, ArtifactCache]:
    """A node on ``tmp/b`` that fetches from ``objects`` into a node cache ``tmp/b-cache`` of ``max_bytes``,
    as the chart's agents with storage.type s3; ``settings`` are the agent's, by name."""
    cache = ArtifactCache(tmp / "b-cache", max_bytes)
    node, runtime = local_executor(
        tmp / "b",
        criu_bin,
        compress_pages=False,
        objects=objects,
        cache=cache,
        kind=Executor,
        runtime_kind=ProcessRuntime,
        **settings,
    )
    return node, runtime, cache


async def checkpoint_worker(
    executor: Executor,
    runtime: ProcessRuntime,
    worker: Path,
    identity_hash: str,
    env: dict[str, str] | None = None,
    *,
    identity: CheckpointIdentity | None = None,
    key: str = "source",
    binding: Binding | None = None,
) -> Workload:
    """Launch ``worker`` (a script using the workload handshake), checkpoint it as ``identity_hash`` (under
    ``binding``'s key where given), and remove its control dir, as on a fresh node; the source workload."""
    source, _ = await checkpoint_worker_outcome(
        executor, runtime, worker, identity_hash, env, identity=identity, key=key, binding=binding
    )
    return source


async def checkpoint_worker_outcome(
    executor: Executor,
    runtime: ProcessRuntime,
    worker: Path,
    identity_hash: str,
    env: dict[str, str] | None = None,
    *,
    identity: CheckpointIdentity | None = None,
    key: str = "source",
    binding: Binding | None = None,
) -> tuple[Workload, CheckpointOutcome]:
    """``checkpoint_worker``, and what the checkpoint reported."""
    spec = WorkloadSpec(key, [sys.executable, str(worker)], {"PYTHONPATH": str(REPO), **(env or {})})
    source = await runtime.launch(spec)
    await executor.wait_ready(source, within=60)
    outcome = await executor.checkpoint(source, identity_hash, identity, binding=binding)
    shutil.rmtree(source.control_dir, ignore_errors=True)
    return source, outcome


async def restore_intact(executor: Executor, runtime: ProcessRuntime, key: str, digest: str) -> str:
    """Restore artifact ``key`` with ``digest`` as workload "restored", check the worker's memory came back
    unchanged, stop it: where the artifact was read (``RestoreOutcome.source``)."""
    outcome = await executor.restore("restored", key, manifest_digest=digest)
    try:
        verdict = await await_json(outcome.workload.control_dir / "verify.json")
        assert verdict["digest_after"] == verdict["digest_before"], "memory changed across the restore"
    finally:
        await runtime.stop("restored")
        await asyncio.to_thread(shutil.rmtree, outcome.workload.control_dir, True)
    return outcome.source


def _listing(directory: Path) -> dict[str, tuple[bool, int]]:
    return {p.name: (p.is_symlink(), p.stat().st_size) for p in directory.iterdir() if p.is_file()}


class RestoreCalls:
    """What the runtime's restore was called with, and the images directory as CRIU found it."""

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.images: list[Path] = []
        self.seen: list[dict[str, tuple[bool, int]]] = []  # name -> (symlink, size)
        restore = runtime.restore

        async def spy(key: str, images_dir: Path, *args: Any, **kwargs: Any) -> Any:
            self.images.append(images_dir)
            self.seen.append(await asyncio.to_thread(_listing, images_dir))
            return await restore(key, images_dir, *args, **kwargs)

        runtime.restore = spy  # type: ignore[method-assign]


async def checkpointed_to_store(
    tmp: Path,
    criu_bin: Path,
    objects: ObjectStore,
    worker: Path,
    identity: CheckpointIdentity,
    env: dict[str, str],
) -> tuple[str, Path]:
    """``worker`` checkpointed on node ``tmp/a`` and written to ``objects`` (as its agent does with an object
    store): the manifest digest, and the control dir the restored worker reports into."""
    a, runtime = local_executor(
        tmp / "a", criu_bin, compress_pages=False, objects=objects, kind=Executor, runtime_kind=ProcessRuntime
    )
    identity_hash = compute_identity_hash(identity)
    source = await checkpoint_worker(a, runtime, worker, identity_hash, env, identity=identity)
    digest = a.store.open(identity_hash).manifest.digest
    assert digest is not None
    return digest, source.control_dir
