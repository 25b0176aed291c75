"""Autoscaling for snapshot-restored services: a pure policy engine (``engine``) that sizes a service from
service-wide metric totals, aware that restored replicas start in seconds."""

from dynamo_snapshot.autoscale.engine import (
    LOOKAHEAD_CAP_S,
    SLOPE_WINDOW_S,
    Decision,
    MetricSample,
    MetricTarget,
    Observation,
    PolicyEngine,
    PolicyParams,
)

__all__ = [
    "LOOKAHEAD_CAP_S",
    "SLOPE_WINDOW_S",
    "Decision",
    "MetricSample",
    "MetricTarget",
    "Observation",
    "PolicyEngine",
    "PolicyParams",
]
