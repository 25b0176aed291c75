"""DynamoScalingPolicy (nvidia.com/v1alpha1): metric-driven replica counts for one service of a graph.

A policy names a service of a DynamoGraphDeployment and the Prometheus queries whose totals measure its
load; the autoscaler sets the service's replicas to keep each total near ``targetPerReplica`` times the
replicas, within ``minReplicas``..``maxReplicas``, and reports what it saw and decided in the status.

Every rule is stated twice, once in pydantic and once as a CEL or OpenAPI rule of the generated CRD, so
the apiserver refuses exactly what Python refuses, with the same message.  Unlike the Dynamo-shaped
kinds, the policy models ignore keys they do not declare and the CRD does not preserve them: a typo
in a policy is refused by the apiserver (kubectl's strict field validation) instead of being kept and
silently doing nothing, while a controller reading a policy written for a newer CRD still parses it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, JsonValue, model_validator

from dynamo_snapshot.api.kube import (
    DNS1123_SUBDOMAIN_MAX_LENGTH,
    DNS1123_SUBDOMAIN_PATTERN,
    Condition,
    CustomResource,
    KubeModel,
    NonNegativeInt32,
    PositiveInt32,
    PrinterColumn,
    ResourceInfo,
    Timestamp,
)
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION

__all__ = [
    "DUPLICATE_METRIC_NAMES_MESSAGE",
    "MAX_METRICS",
    "MAX_QUERY_LENGTH",
    "MIN_EXCEEDS_MAX_MESSAGE",
    "PANIC_THRESHOLD_MESSAGE",
    "TARGET_PER_REPLICA_MESSAGE",
    "TOLERANCE_MESSAGE",
    "DynamoScalingPolicy",
    "DynamoScalingPolicySpec",
    "DynamoScalingPolicyStatus",
    "MetricSpec",
    "PanicPolicy",
    "ScaleDownPolicy",
    "ScaleUpPolicy",
    "ScalingConditionType",
    "ScalingDecision",
    "ScalingTarget",
]

MIN_EXCEEDS_MAX_MESSAGE = "minReplicas must not exceed maxReplicas"
TARGET_PER_REPLICA_MESSAGE = "targetPerReplica must be > 0"
DUPLICATE_METRIC_NAMES_MESSAGE = "metric names must be unique"
TOLERANCE_MESSAGE = "tolerance must be < 1"
PANIC_THRESHOLD_MESSAGE = "panic.threshold must be > 1"

MAX_METRICS = 8
MAX_QUERY_LENGTH = 4096
_METRIC_NAME_MAX_LENGTH = 63
_METRIC_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_SERVICE_NAME_MAX_LENGTH = 253


def _rules(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    entry: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return {"x-kubernetes-validations": [entry]}


# Numbers: strict so "2" (a string) is refused as the apiserver refuses it; ints are accepted as floats.
Seconds = Annotated[float, Field(strict=True)]


def _positive(value: float) -> float:
    if not value > 0:
        raise ValueError(TARGET_PER_REPLICA_MESSAGE)
    return value


def _below_one(value: float) -> float:
    if not value < 1:
        raise ValueError(TOLERANCE_MESSAGE)
    return value


def _above_one(value: float) -> float:
    if not value > 1:
        raise ValueError(PANIC_THRESHOLD_MESSAGE)
    return value


# Sub-objects default to {} in the CRD too, so the apiserver fills in their fields' defaults and the
# stored object shows every value in effect.
_EMPTY_DEFAULT: dict[str, JsonValue] = {"default": {}}


class _PolicyModel(KubeModel):
    """Policy shapes: undeclared keys are dropped (and the CRD prunes them), see the module docstring."""

    model_config = ConfigDict(extra="ignore")


class ScalingTarget(_PolicyModel):
    """The service whose replicas the policy sets."""

    dgd_name: str = Field(
        min_length=1,
        max_length=DNS1123_SUBDOMAIN_MAX_LENGTH,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Name of the DynamoGraphDeployment, in the policy's namespace.",
    )
    service_name: str = Field(
        min_length=1,
        max_length=_SERVICE_NAME_MAX_LENGTH,
        description="Key of the service in the DynamoGraphDeployment's spec.services.",
    )


class MetricSpec(_PolicyModel):
    """One load signal: a PromQL total over the service and the share of it one replica should carry."""

    name: str = Field(
        min_length=1,
        max_length=_METRIC_NAME_MAX_LENGTH,
        pattern=_METRIC_NAME_PATTERN,
        description="Name of the metric, unique within the policy; the key of status.lastMetrics.",
    )
    query: str = Field(
        min_length=1,
        max_length=MAX_QUERY_LENGTH,
        pattern=r"\S",
        description="PromQL instant query returning ONE series or a scalar: the total over all replicas "
        'of the service, e.g. sum(vllm:num_requests_waiting{namespace="ns",pod=~"graph-worker-.*"}). '
        "A query returning several series is an error (wrap it in sum(...)); one returning no data "
        "is treated as a missing metric, not as zero.",
    )
    target_per_replica: Annotated[
        float,
        Field(strict=True),
        AfterValidator(_positive),
    ] = Field(
        description="The value of the total one replica should carry; desired replicas = "
        "ceil(total / targetPerReplica). Must be > 0.",
        json_schema_extra=_rules("self > 0.0", TARGET_PER_REPLICA_MESSAGE),
    )


class ScaleUpPolicy(_PolicyModel):
    """How fast replicas are added: the HPA's scale-up rule (its default step of 4 per 15 s period),
    with a rate of 300 % (x4) per period where the HPA has 100 % (x2).

    The faster rate is for restore: a restored replica serves within seconds, so the HPA's doubling per
    15 s, sized for cold starts of minutes, would hold a burst back for periods (on the trace of
    benchmarks/autoscale_trace.py it more than doubles the SLA-violation seconds; with 300 % they match
    an unlimited scale-up). There is no unlimited scale-up: a query gone wrong (a total of 1e300, say)
    moves the replicas by one step per period, not to maxReplicas in one decision.
    """

    stabilization_window_seconds: Seconds = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Scale up to the lowest desired count seen over this many seconds; default 0 (at once).",
    )
    max_step: PositiveInt32 = Field(
        default=4,
        description="Within any periodSeconds the replicas grow by at most this many, or by maxPercent "
        "where that is more, counted from the fewest replicas the service had in the period; in every "
        "mode, panic included. At least 1; default 4 (the HPA's). There is no unlimited setting.",
    )
    max_percent: PositiveInt32 = Field(
        default=300,
        description="Within any periodSeconds the replicas grow by at most this percentage (rounded up) "
        "of the fewest the service had in the period, where that is more than maxStep; default 300 "
        "(x4 per period: restored replicas serve within seconds; the HPA, made for cold starts, has 100).",
    )
    period_seconds: Seconds = Field(
        default=15.0,
        ge=1,
        le=1800,
        description="The period over which maxStep and maxPercent count the replicas added, in seconds "
        "(1 to 1800); default 15, the HPA's.",
    )


class ScaleDownPolicy(_PolicyModel):
    """How cautiously replicas are removed."""

    stabilization_window_seconds: Seconds = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="Scale down only to the highest desired count seen over this many seconds; default 60.",
    )
    max_step: NonNegativeInt32 = Field(
        default=1,
        description="At most this many replicas removed in one decision; default 1, 0 means no limit.",
    )
    grace_seconds: Seconds = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="A replica younger than this many seconds is never removed (it may still be "
        "starting or warming up); default 30.",
    )


class PanicPolicy(_PolicyModel):
    """Fast reaction to a burst: a short window that may only scale up."""

    window_seconds: Seconds = Field(
        default=6.0,
        ge=0.5,
        le=600,
        description="Length of the short panic window in seconds; default 6.",
    )
    threshold: Annotated[float, Field(strict=True), AfterValidator(_above_one)] = Field(
        default=2.0,
        description="Panic when the desired replicas over the panic window reach threshold times the "
        "current replicas; while panicking the policy scales up without waiting for scaleUp's "
        "stabilization window (still within its maxStep/maxPercent per periodSeconds) and never down. "
        "Must be > 1; default 2.0.",
        json_schema_extra=_rules("self > 1.0", PANIC_THRESHOLD_MESSAGE),
    )


def _metric_names_unique(metrics: list[MetricSpec]) -> list[MetricSpec]:
    names = [metric.name for metric in metrics]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{DUPLICATE_METRIC_NAMES_MESSAGE}: {', '.join(duplicates)}")
    return metrics


class DynamoScalingPolicySpec(_PolicyModel):
    model_config = ConfigDict(
        json_schema_extra=_rules(
            "self.minReplicas <= self.maxReplicas", MIN_EXCEEDS_MAX_MESSAGE, ".minReplicas"
        )
    )

    target: ScalingTarget = Field(description="The DynamoGraphDeployment service to scale.")
    min_replicas: NonNegativeInt32 = Field(
        default=1, description="Fewest replicas; 0 lets the service scale to zero. Default 1."
    )
    max_replicas: PositiveInt32 = Field(
        description="Most replicas; at least minReplicas. The controller caps it (and minReplicas) to its "
        "cluster-wide --max-policy-replicas, saying so in the MaxReplicasCapped condition."
    )
    metrics: Annotated[list[MetricSpec], AfterValidator(_metric_names_unique)] = Field(
        min_length=1,
        max_length=MAX_METRICS,
        description="Load signals (1 to 8); the policy wants the most replicas any of them asks for.",
        json_schema_extra=_rules(
            "self.all(m, self.exists_one(n, n.name == m.name))", DUPLICATE_METRIC_NAMES_MESSAGE
        ),
    )
    evaluation_interval_seconds: Seconds = Field(
        default=2.0, ge=0.5, le=300, description="Seconds between evaluations; default 2."
    )
    tolerance: Annotated[float, Field(strict=True, ge=0), AfterValidator(_below_one)] = Field(
        default=0.1,
        description="No change while every metric's total per current replica is within this fraction "
        "of its targetPerReplica; in [0, 1), default 0.1.",
        json_schema_extra=_rules("self < 1.0", TOLERANCE_MESSAGE),
    )
    scale_up: ScaleUpPolicy = Field(
        default_factory=ScaleUpPolicy,
        json_schema_extra=_EMPTY_DEFAULT,
        description="Scale-up limits; defaults: stabilizationWindowSeconds 0, maxStep 4, maxPercent 300, "
        "periodSeconds 15 (at most max(4, 300%) more replicas per 15 s).",
    )
    scale_down: ScaleDownPolicy = Field(
        default_factory=ScaleDownPolicy,
        json_schema_extra=_EMPTY_DEFAULT,
        description="Scale-down limits; defaults: stabilizationWindowSeconds 60, maxStep 1, graceSeconds 30.",
    )
    panic: PanicPolicy = Field(
        default_factory=PanicPolicy,
        json_schema_extra=_EMPTY_DEFAULT,
        description="Burst handling; defaults: windowSeconds 6, threshold 2.0.",
    )
    stale_after_seconds: Seconds = Field(
        default=10.0,
        ge=0.5,
        le=3600,
        description="A metric not read successfully for this many seconds counts as unavailable, and "
        "the policy holds the replicas where they are; default 10.",
    )
    query_timeout_seconds: Seconds = Field(
        default=2.0, ge=0.1, le=60, description="Timeout of one Prometheus query in seconds; default 2."
    )
    prometheus_url: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        pattern=r"^https?://",
        description="Base URL of the Prometheus to query, e.g. http://prometheus.monitoring:9090; "
        "unset means the controller's default.",
    )

    @model_validator(mode="after")
    def _min_not_above_max(self) -> DynamoScalingPolicySpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_EXCEEDS_MAX_MESSAGE)
        return self


class ScalingConditionType(StrEnum):
    READY = "Ready"
    METRICS_AVAILABLE = "MetricsAvailable"
    SCALING_ACTIVE = "ScalingActive"
    INVALID_SPEC = "InvalidSpec"
    MAX_REPLICAS_CAPPED = "MaxReplicasCapped"


class ScalingDecision(KubeModel):
    """The last replica count the policy decided on, and why."""

    time: Timestamp = Field(description="When the decision was made.")
    desired: NonNegativeInt32 = Field(description="The replicas decided on.")
    reason: str = Field(max_length=1024, description="Why, e.g. which metric asked for the most replicas.")
    panic: bool = Field(default=False, description="Whether the decision was made in panic mode.")


# Values are null while a metric has no data: keeps "missing" apart from a real zero.
_MetricValue = Annotated[float | None, Field(json_schema_extra={"nullable": True})]


class DynamoScalingPolicyStatus(KubeModel):
    observed_generation: int | None = Field(
        default=None, description="The .metadata.generation the status was computed from."
    )
    current_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas of the service now (spec.services[].replicas)."
    )
    desired_replicas: NonNegativeInt32 | None = Field(default=None, description="Replicas the policy wants.")
    ready_replicas: NonNegativeInt32 | None = Field(default=None, description="Replicas ready to serve.")
    starting_replicas: NonNegativeInt32 | None = Field(
        default=None, description="Replicas created but not yet ready."
    )
    last_metrics: dict[str, _MetricValue] | None = Field(
        default=None,
        description="The last total of each metric, by metric name; null when it had no usable value "
        "(no data, a failed query, or a total that is NaN, infinite or negative).",
    )
    last_scale_time: Timestamp | None = Field(default=None, description="When the replicas last changed.")
    last_decision: ScalingDecision | None = None
    conditions: list[Condition] | None = Field(
        default=None,
        description="Ready, MetricsAvailable, ScalingActive, InvalidSpec and MaxReplicasCapped.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class DynamoScalingPolicy(CustomResource):
    """Scales one service of a DynamoGraphDeployment on Prometheus metrics."""

    resource: ClassVar[ResourceInfo] = ResourceInfo(
        group=API_GROUP,
        version=API_VERSION,
        kind="DynamoScalingPolicy",
        plural="dynamoscalingpolicies",
        singular="dynamoscalingpolicy",
        short_names=("dsp",),
        printer_columns=(
            PrinterColumn("DGD", ".spec.target.dgdName", description="Target DynamoGraphDeployment"),
            PrinterColumn("Service", ".spec.target.serviceName", description="Target service"),
            PrinterColumn("Min", ".spec.minReplicas", type="integer", description="Fewest replicas"),
            PrinterColumn("Max", ".spec.maxReplicas", type="integer", description="Most replicas"),
            PrinterColumn("Desired", ".status.desiredReplicas", type="integer", description="Wanted"),
            PrinterColumn("Current", ".status.currentReplicas", type="integer", description="Now"),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
        ),
    )

    api_version: Literal["nvidia.com/v1alpha1"] = "nvidia.com/v1alpha1"
    kind: Literal["DynamoScalingPolicy"] = "DynamoScalingPolicy"
    spec: DynamoScalingPolicySpec
    status: DynamoScalingPolicyStatus | None = None
