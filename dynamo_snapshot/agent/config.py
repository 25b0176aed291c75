"""The node agent's settings: one model, in sections, from which everything else that names a setting is
made (`dynamo-snapshot agent`'s flags, agent/config.yaml, the chart's values schema and the agent's
ConfigMap, the flag list in agent/README.md: `python -m dynamo_snapshot.cli.agent_configgen`).

Each setting's name is unique across the sections: its flag is ``--`` and that name, and a file or a
caller may give it by that name alone (``compressPages: true``) as well as in its section
(``checkpoint: {compressPages: true}``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from dynamo_snapshot.agent.runtime.containerd import CONTAINERD_RUNC_ROOT, CRIO_RUNC_ROOT
from dynamo_snapshot.agent.runtime.runc import DEFAULT_HOST_BINDS
from dynamo_snapshot.artifact.s3 import S3Location
from dynamo_snapshot.criu import RESTORE_READERS_MAX

__all__ = [
    "DEFAULT_RESTORE_SCRATCH",
    "AgentConfig",
    "CacheSettings",
    "CheckpointSettings",
    "ContainerSettings",
    "NodeSettings",
    "ObjectStoreSettings",
    "ObservabilitySettings",
    "RestoreSettings",
    "Size",
    "StoreSettings",
    "TimeoutSettings",
    "ZeroPagesRewrite",
    "settings_fields",
]

# Where a restore unpacks compressed pages for CRIU: a tmpfs, so CRIU reads them at memory speed.
DEFAULT_RESTORE_SCRATCH = Path("/dev/shm/dynamo-snapshot")

_KUBE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])i\s*$")


def _kube_size(value: object) -> object:
    """Kubernetes-style sizes (``200Gi``) as pydantic's ByteSize reads them (``200GiB``)."""
    if isinstance(value, str) and (m := _KUBE_SIZE.match(value)):
        return f"{m[1]}{m[2]}iB"
    return value


# Bytes, written as a number or a size: 200Gi, 200GiB, 1.5TiB, 500GB.
Size = Annotated[ByteSize, BeforeValidator(_kube_size)]


def _on_off(value: object) -> object:
    """A yes/no setting that grew an `auto`: true and false still mean on and off."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


ZeroPagesRewrite = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class _Section(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class NodeSettings(_Section):
    """This node and the host directories the agent keeps its state in."""

    node_name: str = Field(
        default_factory=lambda: os.environ.get("NODE_NAME", ""),
        min_length=1,
        description="this node's name (default: $NODE_NAME)",
    )
    control_root: Path = Field(
        default=Path("/var/lib/dynamo-snapshot/control"),
        description="host directory behind the pods' control dirs",
    )
    state_root: Path = Field(
        default=Path("/var/lib/dynamo-snapshot/runtime"),
        description="runtime state (runc bundles) and the logs of failed CRIU runs",
    )
    criu: Path | None = Field(default=None, description="criu binary (default: $DYNSNAP_CRIU, then PATH)")


class ContainerSettings(_Section):
    """Whose containers the agent checkpoints and restores."""

    runtime: Literal["containerd", "runc", "local"] = Field(
        default="containerd",
        description="containerd: the kubelet's containers (containerd or CRI-O with runc); runc/local: "
        "workers the agent launches itself (launchWorkloads), as runc containers or host processes",
    )
    runc_root: Path = Field(
        default=CONTAINERD_RUNC_ROOT,
        description="runtime containerd: the host's runc root of the kubelet's containers "
        f"({CONTAINERD_RUNC_ROOT} for containerd, {CRIO_RUNC_ROOT} for CRI-O)",
    )
    launch_workloads: bool = Field(
        default=False,
        description="start pods' main containers here (nodes without a kubelet: demo, kwok); needs "
        "runtime runc or local",
    )
    host_binds: list[str] = Field(
        default_factory=lambda: list(DEFAULT_HOST_BINDS),
        description="runc + launchWorkloads: host directories containers see read-only",
    )
    writable_binds: list[str] = Field(
        default_factory=list,
        description="runc + launchWorkloads: host directories containers may write (outside hostBinds)",
    )


class TimeoutSettings(_Section):
    """How long the agent waits for a worker."""

    ready_timeout_seconds: float = Field(
        default=3600, gt=0, description="how long a worker may take to say it is ready to be checkpointed"
    )
    container_start_timeout_seconds: float = Field(
        default=600, gt=0, description="runtime containerd: how long a pod's main container may take to start"
    )
    standby_timeout_seconds: float = Field(
        default=120,
        gt=0,
        description="runtime containerd: how long a restore pod's container may take to say it waits "
        "in standby",
    )


class CheckpointSettings(_Section):
    """What a checkpoint writes."""

    prefetch_node_files: bool = Field(
        default=True,
        description="record the node files a worker maps at checkpoint and read them ahead at restore",
    )
    drop_zero_pages: ZeroPagesRewrite = Field(
        default="off",
        description="leave the all-zero pages of anonymous memory out of checkpoints' CRIU images, a "
        "rewrite after the dump: on; auto, unless the worker dropped the CUDA host copy's zeros itself "
        "(the SDK's workers do, cheaper); off (a stock GPU worker's restore from disk gains, its restore "
        "from the page cache loses: BENCHMARKS.md)",
    )
    zero_pages_huge_advice: bool = Field(
        default=False,
        description="with the zero-page rewrite, mark the private anonymous memory it emptied (2 MiB or "
        "more, filled to half or more before) for huge pages at restore, so what reads it first (a CUDA "
        "restore its host copy) faults it in 2 MiB at a time (not yet measured on a GPU)",
    )
    compress_pages: bool = Field(
        default=False,
        description="store checkpoints' CRIU pages images compressed (unpacked again at each restore): "
        "pays only where restores read a decoupled artifact from disk (BENCHMARKS.md, compressed pages A/B)",
    )


class StoreSettings(_Section):
    """The artifact store checkpoints go into and restores read."""

    artifact_root: Path = Field(
        default=Path("/var/lib/dynamo-snapshot/artifacts"),
        description="the artifact store: a shared volume, or node-local",
    )
    verify_cache_seconds: float = Field(
        default=3600,
        ge=0,
        description="files verified unchanged this recently are not hashed again; 0 hashes every time",
    )


class RestoreSettings(_Section):
    """How a restore reads and checks an artifact."""

    weights_check_idle_io: bool = Field(
        default=True,
        description="check the weights during the CRIU restore at idle I/O priority, so CRIU reads first",
    )
    restore_huge_pages: bool = Field(
        default=True,
        description="CRIU advises transparent huge pages for the private anonymous memory of 2 MiB and "
        "more that a restore fills to half or more, before filling it: fewer page faults for CRIU and a "
        "faster CUDA restore copy; the memory stays huge-page eligible (needs a CRIU built with "
        "scripts/criu-restore-thp.patch, which a stock CRIU and runtime runc ignore)",
    )
    restore_readers: int = Field(
        default=8,
        ge=1,
        le=RESTORE_READERS_MAX,
        description="threads each restored process's pages are read with at once: fresh memory is filled "
        "one page fault at a time per thread (needs a CRIU built with scripts/criu-restore-readers.patch, "
        "which a stock CRIU and runtime runc ignore)",
    )
    restore_scratch: Path = Field(
        default=DEFAULT_RESTORE_SCRATCH,
        description="a tmpfs directory restores unpack compressed pages into (unusable or too small: "
        "beside the control dir)",
    )


class CacheSettings(_Section):
    """The node-local copies of artifacts restored from a shared store or fetched from the object store."""

    cache_root: Path | None = Field(
        default=None,
        description="node-local directory that keeps copies of artifacts restored from a shared artifact "
        "root, or fetched from the object store, so later restores on this node read them locally "
        "(unset: no cache; fetched artifacts then go into artifactRoot, uncapped)",
    )
    cache_max_size: Size = Field(
        default=ByteSize(200 << 30),
        description="most bytes of artifacts the node cache keeps; the least recently restored go first",
    )
    cache_min_free: Size = Field(
        default=ByteSize(10 << 30), description="free space the node cache leaves on its filesystem"
    )


class ObjectStoreSettings(_Section):
    """An S3-compatible object store every checkpoint is written to, so a restore on any node fetches it
    (into the node cache where cacheRoot is set, else into artifactRoot, node-local then) instead of needing
    a shared volume."""

    s3_endpoint: str | None = Field(
        default=None,
        description="http(s)://host[:port] of an S3-compatible store (unset: artifacts stay in artifactRoot)",
    )
    s3_bucket: str = Field(
        default="",
        description="the bucket artifacts go to; {namespace} in it stands for the checkpoint's namespace "
        "(a bucket per namespace, made beforehand)",
    )
    s3_prefix: str = Field(
        default="", description="key prefix in the bucket: empty, or path segments ending with '/'"
    )
    s3_region: str = Field(default="us-east-1", description="the region requests are signed for")
    s3_ca_bundle: Path | None = Field(
        default=None, description="PEM file of the CAs an https endpoint chains to (unset: the system's)"
    )
    s3_credentials_dir: Path = Field(
        default=Path("/var/run/secrets/dynamo-snapshot/s3"),
        description="directory with files AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (a Secret's keys), "
        "read at each transfer",
    )
    s3_parallel: int = Field(default=8, ge=1, le=64, description="requests in flight per transfer")
    s3_prefetch: Literal["none", "scheduled", "all"] = Field(
        default="scheduled",
        description="when a node fetches a checkpoint it lacks: none (as its restore starts), scheduled "
        "(once a restore pod of it is bound to the node, while the kubelet starts it), all (every node, "
        "as soon as the PodSnapshot is Ready)",
    )
    s3_stream_pages: bool = Field(
        default=False,
        description="a restore fetching its artifact starts CRIU before the memory pages are in: with "
        "--lazy-pages, each page served from the fetch once its chunk is in and checked (runtimes local "
        "and containerd; uncompressed pages)",
    )

    s3_stream_weights: bool = Field(
        default=True,
        description="a restore fetching its artifact puts the weights files back while they arrive, for "
        "a worker whose SDK reads each byte only once it is in and checked (its loads overlap the "
        "transfer)",
    )

    def location(self) -> S3Location | None:
        """Where the artifacts go; None without an endpoint. ``ValueError`` for a bad bucket or prefix."""
        if self.s3_endpoint is None:
            return None
        return S3Location(
            endpoint=self.s3_endpoint,
            bucket=self.s3_bucket,
            prefix=self.s3_prefix,
            region=self.s3_region,
            ca_bundle=self.s3_ca_bundle,
            parallel=self.s3_parallel,
        )


class ObservabilitySettings(_Section):
    """The agent's own endpoints."""

    metrics_port: int = Field(default=9090, ge=0, le=65535, description="Prometheus metrics; 0 disables")
    health_port: int = Field(default=8082, ge=0, le=65535, description="/healthz and /readyz; 0 disables")


class AgentConfig(BaseModel):
    """agent/config.yaml; flags override it."""

    # Settings may come by name alone (see _settings_by_name), which rejects what is no setting itself.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    node: NodeSettings = Field(default_factory=NodeSettings)
    containers: ContainerSettings = Field(default_factory=ContainerSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    restore: RestoreSettings = Field(default_factory=RestoreSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    s3: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)

    @model_validator(mode="before")
    @classmethod
    def _settings_by_name(cls, data: Any) -> Any:
        """A setting given by its name alone goes into its section, over what the section says of it."""
        if not isinstance(data, dict):
            return data
        sections = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items() if s in _SECTIONS}
        for key, value in data.items():
            if key in _SECTIONS:
                continue
            found = _BY_NAME.get(key)
            if found is None:
                raise ValueError(f"{key}: no such setting")
            section, name = found
            target = sections.setdefault(section, {})
            if isinstance(target, dict):
                target.pop(name, None)
                target.pop(to_camel(name), None)
                target[name] = value
        return sections

    @model_validator(mode="after")
    def _launching_runtime(self) -> AgentConfig:
        if self.containers.launch_workloads and self.containers.runtime == "containerd":
            raise ValueError(
                "launchWorkloads starts workers without a kubelet: it needs runtime runc or local, "
                "not containerd (whose containers the kubelet starts)"
            )
        return self

    @model_validator(mode="after")
    def _ports(self) -> AgentConfig:
        ports = self.observability
        if ports.metrics_port and ports.metrics_port == ports.health_port:
            raise ValueError(
                f"metricsPort and healthPort are both {ports.metrics_port}: give them different ports"
            )
        return self

    @model_validator(mode="after")
    def _object_store(self) -> AgentConfig:
        try:
            self.s3.location()
        except ValidationError as e:
            fields = [(to_camel(f"s3_{err['loc'][0]}"), err["msg"]) for err in e.errors()]
            problems = "; ".join(f"{name}: {msg}" for name, msg in fields)
            raise ValueError(f"s3: {problems}") from None
        return self

    @model_validator(mode="after")
    def _cache_apart(self) -> AgentConfig:
        cache = self.cache
        if cache.cache_root is None:
            return self
        root, store = cache.cache_root.resolve(), self.store.artifact_root.resolve()
        if root == store or store in root.parents or root in store.parents:
            raise ValueError(
                f"cacheRoot {cache.cache_root} must be a directory of its own, apart from artifactRoot "
                f"{self.store.artifact_root} (the cache removes what it holds)"
            )
        if cache.cache_max_size <= 0:
            raise ValueError("cacheMaxSize must be more than 0 bytes")
        return self


def settings_fields() -> Iterator[tuple[str, str, type[BaseModel]]]:
    """(section, setting, section model) for every setting, in the model's order."""
    for section, info in AgentConfig.model_fields.items():
        model = info.annotation
        assert isinstance(model, type)
        assert issubclass(model, BaseModel)
        for name in model.model_fields:
            yield section, name, model


_SECTIONS = frozenset(AgentConfig.model_fields)
# A setting by its name and by its camelCase key: (section, name).
_BY_NAME = {key: (section, name) for section, name, _ in settings_fields() for key in (name, to_camel(name))}
