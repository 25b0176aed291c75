"""`dynamo-snapshot agent`: the per-node agent (DaemonSet pod, or a local process for dev nodes)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.object_store import ObjectStore
from dynamo_snapshot.agent.privileges import check_privileges
from dynamo_snapshot.agent.runtime import ProcessRuntime, RuncRuntime, Runtime
from dynamo_snapshot.agent.runtime.containerd import ContainerdRuntime
from dynamo_snapshot.agent.watcher import NodeAgent
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore
from dynamo_snapshot.cli.health import health_endpoints
from dynamo_snapshot.cli.service import load_settings, run_service
from dynamo_snapshot.cli.settings_flags import add_setting_flags, setting_names
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.kube import Kube, load_client

__all__ = ["CRIU_LOGS_DIR", "FIELD_MANAGER", "AgentConfig", "build", "readiness", "register", "run"]

FIELD_MANAGER = "dynamo-snapshot-agent"

log = logging.getLogger(__name__)

# Under the state root, beside the runtimes' own directories (workload keys always hold a "_").
CRIU_LOGS_DIR = "criu-logs"

# Every setting has its flag, named as the setting (``--drop-zero-pages``).
_FLAGS = setting_names()


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agent",
        help="run the node agent (checkpoint and restore workers on this node)",
        description="Watch pods bound to this node: checkpoint checkpoint sources, restore restore targets.",
    )
    p.add_argument("--config", type=Path, help="YAML settings (see agent/config.yaml)")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    add_setting_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


def build(config: AgentConfig, kube: Kube) -> NodeAgent:
    node, containers = config.node, config.containers
    # A failed dump's or restore's work directory goes with the failure; the log its message names stays.
    criu = Criu(
        node.criu,
        kept_logs=node.state_root / CRIU_LOGS_DIR,
        restore_huge_pages=config.restore.restore_huge_pages,
        restore_readers=config.restore.restore_readers,
    )
    runtime: Runtime
    if containers.runtime == "containerd":
        runtime = ContainerdRuntime(criu, node.state_root, runc_root=containers.runc_root)
    elif containers.runtime == "runc":
        runtime = RuncRuntime(
            node.state_root,
            node.control_root,
            criu_binary=criu.binary,
            host_binds=containers.host_binds,
            writable_binds=containers.writable_binds,
        )
    else:
        runtime = ProcessRuntime(node.control_root, criu)
    cache = config.cache
    location = config.s3.location()
    executor = Executor(
        runtime,
        ArtifactStore(config.store.artifact_root),
        criu,
        config,
        cache=(
            ArtifactCache(cache.cache_root, cache.cache_max_size, min_free_bytes=cache.cache_min_free)
            if cache.cache_root is not None
            else None
        ),
        objects=ObjectStore(location, config.s3.s3_credentials_dir) if location is not None else None,
    )
    return NodeAgent(kube, executor, runtime)


def run(args: argparse.Namespace) -> int:
    return run_service(
        "agent",
        args,
        lambda: load_settings(AgentConfig, args.config, args, _FLAGS),
        lambda config, stop: _main(config, args.kubeconfig, stop),
    )


def readiness(agent: NodeAgent) -> str | None:
    """None once the agent sees every pod of its node; before that it could miss a restore target."""
    if agent.pods.has_synced.is_set():
        return None
    return f"pods of node {agent.node_name} not listed yet"


async def _main(config: AgentConfig, kubeconfig: str | None, stop: asyncio.Event) -> None:
    # First, so that a slow start (CRIU check, API server) reads as not ready rather than not alive.
    ports = config.observability
    async with health_endpoints(ports.health_port, starting="starting") as health:
        runc_root = config.containers.runc_root if config.containers.runtime == "containerd" else None
        lacking = await asyncio.to_thread(check_privileges, runc_root=runc_root)
        if lacking:
            log.warning(
                "without these capabilities only workers running as root can be checkpointed and restored",
                extra={"lacking": ", ".join(f"CAP_{name}" for name in lacking)},
            )
        await Criu(config.node.criu).require()
        if ports.metrics_port:
            start_http_server(ports.metrics_port)
        api_client = await load_client(kubeconfig)
        async with api_client:
            agent = build(config, Kube(api_client, field_manager=FIELD_MANAGER))
            health.use(lambda: readiness(agent))
            await agent.run_until(stop)
