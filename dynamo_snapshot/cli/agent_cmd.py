"""`dynamo-snapshot agent`: the per-node agent (DaemonSet pod, or a local process for dev nodes)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from prometheus_client import start_http_server
from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from dynamo_snapshot.agent.executor import DEFAULT_RESTORE_SCRATCH, Executor
from dynamo_snapshot.agent.privileges import check_privileges
from dynamo_snapshot.agent.runtime import ProcessRuntime, RuncRuntime, Runtime
from dynamo_snapshot.agent.runtime.containerd import CONTAINERD_RUNC_ROOT, CRIO_RUNC_ROOT, ContainerdRuntime
from dynamo_snapshot.agent.runtime.runc import DEFAULT_HOST_BINDS
from dynamo_snapshot.agent.watcher import AgentSettings, NodeAgent
from dynamo_snapshot.artifact import ArtifactCache, ArtifactStore
from dynamo_snapshot.cli.health import distinct_ports, health_endpoints
from dynamo_snapshot.cli.service import load_settings, run_service
from dynamo_snapshot.criu import Criu
from dynamo_snapshot.kube import Kube, load_client

FIELD_MANAGER = "dynamo-snapshot-agent"


_KUBE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])i\s*$")

log = logging.getLogger(__name__)


def _kube_size(value: object) -> object:
    """Kubernetes-style sizes (``200Gi``) as pydantic's ByteSize reads them (``200GiB``)."""
    if isinstance(value, str) and (m := _KUBE_SIZE.match(value)):
        return f"{m[1]}{m[2]}iB"
    return value


# Bytes, written as a number or a size: 200Gi, 200GiB, 1.5TiB, 500GB.
Size = Annotated[ByteSize, BeforeValidator(_kube_size)]


# Under --state-root, beside the runtimes' own directories (workload keys always hold a "_").
CRIU_LOGS_DIR = "criu-logs"


class AgentConfig(BaseModel):
    """agent/config.yaml; flags override it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    node_name: str = Field(default_factory=lambda: os.environ.get("NODE_NAME", ""), min_length=1)
    artifact_root: Path = Path("/var/lib/dynamo-snapshot/artifacts")
    control_root: Path = Path("/var/lib/dynamo-snapshot/control")
    state_root: Path = Path("/var/lib/dynamo-snapshot/runtime")
    runtime: Literal["containerd", "runc", "local"] = Field(
        default="containerd",
        description="containerd: the kubelet's containers (containerd or CRI-O with runc); runc/local: "
        "workers the agent launches itself (launchWorkloads)",
    )
    runc_root: Path = Field(
        default=CONTAINERD_RUNC_ROOT,
        description="runtime containerd: the host's runc root of the kubelet's containers "
        f"({CONTAINERD_RUNC_ROOT} for containerd, {CRIO_RUNC_ROOT} for CRI-O)",
    )
    launch_workloads: bool = Field(
        default=False, description="start pods' main containers here (nodes without a kubelet: demo, kwok)"
    )
    ready_timeout_seconds: float = Field(default=3600, gt=0)
    container_start_timeout_seconds: float = Field(
        default=600, gt=0, description="runtime containerd: how long a pod's main container may take to start"
    )
    standby_timeout_seconds: float = Field(
        default=120,
        gt=0,
        description="runtime containerd: how long a restore pod's container may take to say it waits "
        "in standby",
    )
    verify_cache_seconds: float = Field(
        default=3600,
        ge=0,
        description="files verified unchanged this recently are not hashed again; 0 hashes every time",
    )
    prefetch_node_files: bool = Field(
        default=True,
        description="record the node files a worker maps at checkpoint and read them ahead at restore",
    )
    weights_check_idle_io: bool = Field(
        default=True,
        description="check the weights during the CRIU restore at idle I/O priority, so CRIU reads first",
    )
    drop_zero_pages: bool = Field(
        default=False,
        description="leave the all-zero pages of anonymous memory out of checkpoints' CRIU images (a "
        "rewrite after the dump; the SDK's workers drop the CUDA host copy's zeros themselves, cheaper)",
    )
    compress_pages: bool = Field(
        default=False,
        description="store checkpoints' CRIU pages images compressed (unpacked again at each restore): "
        "pays only where restores read a decoupled artifact from disk (BENCHMARKS.md, compressed pages A/B)",
    )
    restore_scratch: Path = Field(
        default=DEFAULT_RESTORE_SCRATCH,
        description="a tmpfs directory restores unpack compressed pages into (else beside the control dir)",
    )
    cache_root: Path | None = Field(
        default=None,
        description="node-local directory that keeps copies of artifacts restored from the artifact "
        "root, so later restores on this node read them locally (unset: no cache)",
    )
    cache_max_size: Size = Field(
        default=ByteSize(200 << 30),
        description="most bytes of artifacts the node cache keeps; the least recently restored go first",
    )
    cache_min_free: Size = Field(
        default=ByteSize(10 << 30), description="free space the node cache leaves on its filesystem"
    )
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    health_port: int = Field(default=8082, ge=0, le=65535, description="/healthz and /readyz; 0 disables")
    criu: Path | None = None
    host_binds: list[str] = Field(
        default_factory=lambda: list(DEFAULT_HOST_BINDS),
        description="runc + launchWorkloads: host directories containers see read-only",
    )
    writable_binds: list[str] = Field(
        default_factory=list,
        description="runc + launchWorkloads: host directories containers may write (outside hostBinds)",
    )

    @model_validator(mode="after")
    def _launching_runtime(self) -> AgentConfig:
        if self.launch_workloads and self.runtime == "containerd":
            raise ValueError(
                "launchWorkloads starts workers without a kubelet: it needs runtime runc or local, "
                "not containerd (whose containers the kubelet starts)"
            )
        return self

    @model_validator(mode="after")
    def _ports(self) -> AgentConfig:
        distinct_ports(self.metrics_port, self.health_port)
        return self

    @model_validator(mode="after")
    def _cache_apart(self) -> AgentConfig:
        if self.cache_root is None:
            return self
        cache, store = self.cache_root.resolve(), self.artifact_root.resolve()
        if cache == store or store in cache.parents or cache in store.parents:
            raise ValueError(
                f"cacheRoot {self.cache_root} must be a directory of its own, apart from artifactRoot "
                f"{self.artifact_root} (the cache removes what it holds)"
            )
        if self.cache_max_size <= 0:
            raise ValueError("cacheMaxSize must be more than 0 bytes")
        return self


_FLAGS = (
    "node_name",
    "artifact_root",
    "control_root",
    "state_root",
    "runtime",
    "runc_root",
    "launch_workloads",
    "ready_timeout_seconds",
    "container_start_timeout_seconds",
    "standby_timeout_seconds",
    "verify_cache_seconds",
    "prefetch_node_files",
    "weights_check_idle_io",
    "drop_zero_pages",
    "compress_pages",
    "restore_scratch",
    "cache_root",
    "cache_max_size",
    "cache_min_free",
    "metrics_port",
    "health_port",
    "criu",
)


def _described(field: str) -> str:
    """A setting's help: its description and, where it has one, its default as a flag would give it."""
    info = AgentConfig.model_fields[field]
    text = info.description or field
    if isinstance(info.default, bool):
        return f"{text} (default {'on' if info.default else 'off'})"
    if isinstance(info.default, ByteSize):
        return f"{text} (default {info.default.human_readable()})"
    return text


def _switch(p: argparse.ArgumentParser, field: str) -> None:
    """--FIELD/--no-FIELD for a bool setting."""
    p.add_argument(
        "--" + field.replace("_", "-"),
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_described(field),
    )


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agent",
        help="run the node agent (checkpoint and restore workers on this node)",
        description="Watch pods bound to this node: checkpoint checkpoint sources, restore restore targets.",
    )
    p.add_argument("--config", type=Path, help="YAML settings (see agent/config.yaml)")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME)")
    p.add_argument("--artifact-root", type=Path, help="artifact store (shared volume or node-local)")
    p.add_argument("--control-root", type=Path, help="host directories behind pods' control dirs")
    p.add_argument("--state-root", type=Path, help="runtime state (runc bundles)")
    p.add_argument(
        "--runtime",
        choices=["containerd", "runc", "local"],
        help="the kubelet's containers (default), or workers the agent launches: runc containers, "
        "host processes",
    )
    p.add_argument("--runc-root", type=Path, help=_described("runc_root"))
    _switch(p, "launch_workloads")
    p.add_argument("--ready-timeout-seconds", type=float, help="how long a worker may take to get ready")
    p.add_argument(
        "--container-start-timeout-seconds", type=float, help=_described("container_start_timeout_seconds")
    )
    p.add_argument("--standby-timeout-seconds", type=float, help=_described("standby_timeout_seconds"))
    p.add_argument(
        "--verify-cache-seconds",
        type=float,
        help="skip re-hashing artifact files verified unchanged this recently (3600; 0: hash every restore)",
    )
    _switch(p, "prefetch_node_files")
    _switch(p, "weights_check_idle_io")
    _switch(p, "drop_zero_pages")
    _switch(p, "compress_pages")
    p.add_argument(
        "--restore-scratch",
        type=Path,
        help=f"tmpfs directory restores unpack compressed pages into (default {DEFAULT_RESTORE_SCRATCH})",
    )
    p.add_argument("--cache-root", type=Path, help=_described("cache_root"))
    p.add_argument("--cache-max-size", help=_described("cache_max_size"))
    p.add_argument("--cache-min-free", help=_described("cache_min_free"))
    p.add_argument("--metrics-port", type=int, help="Prometheus metrics port, 0 disables (default 9090)")
    p.add_argument("--health-port", type=int, help="/healthz and /readyz port, 0 disables (default 8082)")
    p.add_argument("--criu", type=Path, help="criu binary (default: $DYNSNAP_CRIU, then PATH)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


def build(config: AgentConfig, kube: Kube) -> NodeAgent:
    # A failed dump's or restore's work directory goes with the failure; the log its message names stays.
    criu = Criu(config.criu, kept_logs=config.state_root / CRIU_LOGS_DIR)
    runtime: Runtime
    if config.runtime == "containerd":
        runtime = ContainerdRuntime(criu, config.state_root, runc_root=config.runc_root)
    elif config.runtime == "runc":
        runtime = RuncRuntime(
            config.state_root,
            config.control_root,
            criu_binary=criu.binary,
            host_binds=config.host_binds,
            writable_binds=config.writable_binds,
        )
    else:
        runtime = ProcessRuntime(config.control_root, criu)
    executor = Executor(
        runtime,
        ArtifactStore(config.artifact_root),
        criu,
        node_name=config.node_name,
        verify_cache_s=config.verify_cache_seconds,
        prefetch_node_files=config.prefetch_node_files,
        weights_check_idle_io=config.weights_check_idle_io,
        drop_zero_pages=config.drop_zero_pages,
        compress_pages=config.compress_pages,
        restore_scratch=config.restore_scratch,
        cache=(
            ArtifactCache(config.cache_root, config.cache_max_size, min_free_bytes=config.cache_min_free)
            if config.cache_root is not None
            else None
        ),
    )
    settings = AgentSettings(
        node_name=config.node_name,
        launch_workloads=config.launch_workloads,
        ready_timeout=config.ready_timeout_seconds,
        container_start_timeout=config.container_start_timeout_seconds,
        standby_timeout=config.standby_timeout_seconds,
    )
    return NodeAgent(kube, executor, runtime, settings)


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
    return f"pods of node {agent.settings.node_name} not listed yet"


async def _main(config: AgentConfig, kubeconfig: str | None, stop: asyncio.Event) -> None:
    # First, so that a slow start (CRIU check, API server) reads as not ready rather than not alive.
    async with health_endpoints(config.health_port, starting="starting") as health:
        runc_root = config.runc_root if config.runtime == "containerd" else None
        lacking = await asyncio.to_thread(check_privileges, runc_root=runc_root)
        if lacking:
            log.warning(
                "without these capabilities only workers running as root can be checkpointed and restored",
                extra={"lacking": ", ".join(f"CAP_{name}" for name in lacking)},
            )
        await Criu(config.criu).require()
        if config.metrics_port:
            start_http_server(config.metrics_port)
        api_client = await load_client(kubeconfig)
        async with api_client:
            agent = build(config, Kube(api_client, field_manager=FIELD_MANAGER))
            health.use(lambda: readiness(agent))
            await agent.run_until(stop)
