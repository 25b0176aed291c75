"""The controller's settings: one model that controller/config.yaml, the CLI flags, the Controller and
every reconciler (through Context.settings) all read, so a default is written down exactly once."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# What the controller calls itself towards the apiserver: the field manager of its writes, the source of
# its Events and its Lease. One name, so server-side apply ownership and `kubectl get events` agree.
CONTROLLER_NAME = "dynamo-snapshot-controller"


class InstallMode(StrEnum):
    """Who runs the DynamoGraphDeployments: this controller, or NVIDIA's Dynamo operator beside it."""

    # This project's DGD CRD is installed and this controller creates the DGDs' worker pods.
    STANDALONE = "standalone"
    # NVIDIA's Dynamo operator owns the DGD CRD and runs the DGDs: this controller runs the snapshot API
    # (PodSnapshots, SnapshotJobs, DynamoCheckpoints, the restore webhook), scales the operator's DGDs and
    # fails over its worker pods by restore.
    DYNAMO_OPERATOR = "dynamo-operator"


class ControllerConfig(BaseModel):
    """Settings of one controller process (controller/config.yaml, overridden by flags)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    mode: InstallMode = Field(
        default=InstallMode.STANDALONE,
        description="standalone: run the DynamoGraphDeployments; dynamo-operator: leave them to NVIDIA's "
        "Dynamo operator (no DGD pods, no DGD status; the autoscaler scales them through their scaling "
        "adapters, and failover deletes the operator's lost workers so that they restore).",
    )
    namespace: str | None = Field(default=None, description="Watch one namespace; None watches all.")
    workers: int = Field(default=8, ge=1, le=256, description="Objects reconciled in parallel.")
    resync_seconds: float = Field(default=300.0, gt=0, description="Period of the full re-reconcile.")
    leader_elect: bool = True
    lease_name: str = CONTROLLER_NAME
    lease_namespace: str = "default"
    restore_failure_threshold: int = Field(
        default=3, ge=1, description="Failed restores that fail a checkpoint."
    )
    restore_node_attempts: int = Field(
        default=2,
        ge=1,
        le=10,
        description="Different nodes one replica's restore is tried on before it starts cold.",
    )
    restore_pending_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Seconds a restore pod may stay unschedulable before a cold start replaces it.",
    )
    snapshot_pickup_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a PodSnapshot's content may wait for the node agent of its pod's node to take "
        "the capture up before the PodSnapshot fails (NoNodeAgent: a pod on a node without an agent).",
    )
    node_loss_grace_seconds: float = Field(
        default=300.0,
        ge=0,
        description="Seconds a node may be NotReady or unreachable, counted from its Ready condition's "
        "lastTransitionTime, before its workers count as lost (Kubernetes evicts after the same 300 s: "
        "DefaultTolerationSeconds). A deleted node's workers are lost at once.",
    )
    unhealthy_nodes_threshold: float = Field(
        default=0.55,
        gt=0,
        le=1,
        description="Fraction of the nodes NotReady or unreachable at once (and at least 3 of them, or all) "
        "at which workers are no longer replaced for node causes: a control-plane outage, not failed "
        "nodes (kube-controller-manager's --unhealthy-zone-threshold).",
    )
    crash_backoff_initial_seconds: float = Field(
        default=10.0,
        gt=0,
        description="First wait before replacing a worker of a service whose workers die young; doubles "
        "with each further early death.",
    )
    crash_backoff_max_seconds: float = Field(
        default=300.0, gt=0, description="The longest wait of the crash-loop backoff."
    )
    crash_backoff_reset_seconds: float = Field(
        default=600.0,
        gt=0,
        description="A worker that lived this long (from its pod's startTime) did not die young, and a "
        "service with no early death for this long starts its backoff over.",
    )
    drain_timeout: float = Field(
        default=20.0, ge=0, description="Seconds in-flight reconciles get on SIGTERM."
    )
    metrics_port: int = Field(default=8080, ge=0, le=65535, description="0 disables the metrics server.")
    autoscale: bool = Field(default=True, description="Run the DynamoScalingPolicy autoscaler.")
    prometheus_url: str = Field(
        default="http://prometheus:9090",
        description="Prometheus the autoscaler queries when a policy names none.",
    )
    max_policy_replicas: int = Field(
        default=1000,
        ge=1,
        le=2**31 - 1,
        description="The most replicas any DynamoScalingPolicy may set, cluster-wide: a policy's maxReplicas "
        "(and minReplicas) above it is capped to it, with the policy's MaxReplicasCapped condition and a "
        "Warning Event saying so. A last line behind each policy's own bounds and rate limit, against a "
        "policy written or gone wrong; raise it for services meant to run more replicas.",
    )
    autoscale_tick_seconds: float = Field(
        default=0.25, gt=0, le=10, description="How often the autoscaler looks for policies that are due."
    )

    @property
    def runs_dgds(self) -> bool:
        """Whether this controller runs the DGDs (their worker pods and status)."""
        return self.mode is InstallMode.STANDALONE

    @model_validator(mode="after")
    def _backoff_bounds(self) -> ControllerConfig:
        if self.crash_backoff_initial_seconds > self.crash_backoff_max_seconds:
            raise ValueError(
                f"crashBackoffInitialSeconds ({self.crash_backoff_initial_seconds:g}) is above "
                f"crashBackoffMaxSeconds ({self.crash_backoff_max_seconds:g})"
            )
        return self
