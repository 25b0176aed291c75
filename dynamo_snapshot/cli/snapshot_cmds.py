"""`dynamo-snapshot checkpoint | restore | inspect`: the agent's mechanics without Kubernetes.

    dynamo-snapshot checkpoint --pid 1234 --out /var/tmp/store [--identity identity.yaml]
    dynamo-snapshot restore /var/tmp/store/<hash>
    dynamo-snapshot inspect /var/tmp/store/<hash> [--verify]

An artifact this command takes lives at <store>/<identity hash>; with --identity the hash is Dynamo's
identity hash of that file, else a fresh random one. restore and inspect also take an artifact the node
agent made for a DynamoCheckpoint, <store>/<namespace>/<checkpoint uid>.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
import tempfile
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import AgentError, Executor, Timings
from dynamo_snapshot.agent.runtime import ProcessRuntime, Workload
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash
from dynamo_snapshot.artifact import Artifact, ArtifactError, ArtifactStore, validate_artifact_key
from dynamo_snapshot.cli.bounded_yaml import safe_load_bounded
from dynamo_snapshot.criu import Criu, CriuError

T = TypeVar("T")
console = Console(stderr=True)


def register(sub: Any) -> None:
    c: argparse.ArgumentParser = sub.add_parser(
        "checkpoint", help="checkpoint a running process tree (CUDA+CRIU)"
    )
    c.add_argument(
        "--pid", type=int, required=True, help="root pid of the tree to checkpoint (it is stopped)"
    )
    c.add_argument("--out", type=Path, required=True, help="artifact store directory")
    c.add_argument(
        "--identity", type=Path, help="YAML/JSON checkpoint identity; names the artifact by its hash"
    )
    c.add_argument("--criu", type=Path, help="criu binary")
    c.set_defaults(run=lambda a: _run(_checkpoint(a)))

    r: argparse.ArgumentParser = sub.add_parser(
        "restore", help="restore an artifact as a running process tree"
    )
    r.add_argument(
        "artifact", type=Path, help="artifact directory (<store>/<hash> or <store>/<namespace>/<uid>)"
    )
    r.add_argument("--criu", type=Path, help="criu binary")
    r.set_defaults(run=lambda a: _run(_restore(a)))

    i: argparse.ArgumentParser = sub.add_parser("inspect", help="print an artifact's manifest")
    i.add_argument(
        "artifact", type=Path, help="artifact directory (<store>/<hash> or <store>/<namespace>/<uid>)"
    )
    i.add_argument("--verify", action="store_true", help="also check every file's size and SHA-256")
    i.set_defaults(run=lambda a: _run(_inspect(a)))


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(coro)
    except (AgentError, ArtifactError, CriuError, ValueError, OSError) as e:
        # One line, whatever the terminal's width; the message's own brackets are not markup.
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 1


def _executor(criu_path: Path | None, store_root: Path) -> Executor:
    criu = Criu(criu_path)
    runtime = ProcessRuntime(Path(tempfile.mkdtemp(prefix="dynamo-snapshot-cli-")), criu)
    return Executor(runtime, ArtifactStore(store_root), criu, AgentConfig(node_name=socket.gethostname()))


async def _phase(label: str, work: Awaitable[T]) -> T:
    with console.status(label):
        return await work


async def _checkpoint(args: argparse.Namespace) -> int:
    identity = _load_identity(args.identity) if args.identity else None
    ident_hash = compute_identity_hash(identity) if identity else secrets.token_hex(8)
    executor = _executor(args.criu, args.out)
    await executor.criu.require()
    control = _control_dir_of(args.pid)
    workload = Workload("cli", args.pid, control or Path("/nonexistent"))
    outcome = await _phase(
        f"checkpointing pid {args.pid}", executor.checkpoint(workload, ident_hash, identity)
    )
    _print_timings(
        "checkpoint",
        outcome.timings,
        {"artifact": outcome.location, "size": f"{outcome.artifact_bytes / 2**30:.2f} GiB"},
    )
    print(outcome.location)
    return 0


def _locate(path: Path) -> tuple[Path, str]:
    """The store root and key of the artifact directory ``path``; ``ValueError`` naming both forms."""
    for depth in (1, 2):
        if len(path.parts) > depth:
            key = "/".join(path.parts[-depth:])
            try:
                return path.parents[depth - 1], validate_artifact_key(key)
            except ValueError:
                continue
    raise ValueError(
        f"{path} is not an artifact directory: need <store>/<identity hash> (16 lowercase hex digits) "
        "or <store>/<namespace>/<checkpoint uid>"
    )


async def _restore(args: argparse.Namespace) -> int:
    root, key = _locate(args.artifact.resolve())
    executor = _executor(args.criu, root)
    await executor.criu.require()
    outcome = await _phase(f"restoring {root / key}", executor.restore(f"cli-{secrets.token_hex(3)}", key))
    _print_timings("restore", outcome.timings, {"pid": str(outcome.workload.pid)})
    print(outcome.workload.pid)
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    artifact = await asyncio.to_thread(_open, args.artifact.resolve())
    manifest = artifact.manifest
    if manifest.digest is not None:
        console.print(f"sealed: manifest digest {manifest.digest}", markup=False, soft_wrap=True)
    else:
        console.print(
            f"not sealed: a format_version {manifest.format_version} manifest has no digest", soft_wrap=True
        )
    binding = manifest.binding
    if binding is not None:
        console.print(
            f"bound to: DynamoCheckpoint {binding.namespace}/{binding.checkpoint_name} "
            f"(uid {binding.checkpoint_uid}), taken from pod {binding.source_pod} "
            f"(uid {binding.source_pod_uid})",
            markup=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"bound to: no checkpoint (a CLI artifact of identity {manifest.identity_hash})", soft_wrap=True
        )
    if args.verify:
        stats = await _phase("verifying", artifact.averify())
        console.print(f"[green]verified[/] {stats.bytes / 2**30:.2f} GiB in {stats.seconds:.1f}s")
    print(manifest.model_dump_json(indent=2, by_alias=True, exclude_none=True))
    return 0


def _open(path: Path) -> Artifact:
    """The artifact at ``path``; in a store (named by its key) held to that key as a restore would be."""
    try:
        root, key = _locate(path)
    except ValueError:
        return Artifact.load(path)
    return ArtifactStore(root).open(key)


def _load_identity(path: Path) -> CheckpointIdentity:
    try:
        return CheckpointIdentity.model_validate(safe_load_bounded(path.read_text()))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _control_dir_of(pid: int) -> Path | None:
    """The snapshot control dir the process was started with, if any (read from its environment)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read process {pid}: {e.strerror}") from None
    env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    for name in protocol.ENV_CONTROL_DIRS:
        if env.get(name):
            return Path(env[name])
    return None


def _print_timings(op: str, timings: Timings, facts: dict[str, str]) -> None:
    table = Table(title=f"{op} ({timings.total():.2f}s)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for phase, seconds in timings.phases.items():
        table.add_row(phase, f"{seconds:.3f}")
    for key, value in facts.items():
        table.add_row(key, value)
    console.print(table)
