"""The controller's settings: one model that controller/config.yaml, the CLI flags, the Controller and
every reconciler (through Context.settings) all read, so a default is written down exactly once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# What the controller calls itself towards the apiserver: the field manager of its writes, the source of
# its Events and its Lease. One name, so server-side apply ownership and `kubectl get events` agree.
CONTROLLER_NAME = "dynamo-snapshot-controller"


class ControllerConfig(BaseModel):
    """Settings of one controller process (controller/config.yaml, overridden by flags)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

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
    drain_timeout: float = Field(
        default=20.0, ge=0, description="Seconds in-flight reconciles get on SIGTERM."
    )
    metrics_port: int = Field(default=8080, ge=0, le=65535, description="0 disables the metrics server.")
    autoscale: bool = Field(default=True, description="Run the DynamoScalingPolicy autoscaler.")
    prometheus_url: str = Field(
        default="http://prometheus:9090",
        description="Prometheus the autoscaler queries when a policy names none.",
    )
    autoscale_tick_seconds: float = Field(
        default=0.25, gt=0, le=10, description="How often the autoscaler looks for policies that are due."
    )
