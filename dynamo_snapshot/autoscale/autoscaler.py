"""The autoscaler: every DynamoScalingPolicy evaluated on its own interval against Prometheus, its
decision written where its target's replicas are (``targets``: the DGD service's, which the DGD reconciler
turns into restore pods within a reconcile; beside NVIDIA's Dynamo operator, the service's scaling adapter
or the operator's DGD), and the why into the policy's status, Conditions and Events.

No policy gets more replicas than `max_policy_replicas`, the controller's cluster-wide ceiling: a
maxReplicas above it is capped to it and the policy says so (condition MaxReplicasCapped, a Warning
Event). A total that is NaN, infinite or negative is refused like a failed query (MetricsAvailable
False, UnusableValue): it never moves the count.

One loop ticks every `tick_s` and evaluates the policies that are due; all queries of one tick go
through one TickCache, so policies sharing a query cost Prometheus one request. The engines (with their
stabilization history) live in memory: a restarted controller starts them afresh, which can only delay a
scale-down (the windows refill), never cause one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from dynamo_snapshot.api import conditions as cond
from dynamo_snapshot.api import protocol
from dynamo_snapshot.api.conditions import validation_message
from dynamo_snapshot.api.scalingpolicy import DynamoScalingPolicy, DynamoScalingPolicySpec
from dynamo_snapshot.api.views import Meta, ObjectView
from dynamo_snapshot.autoscale.engine import (
    Decision,
    MetricSample,
    MetricTarget,
    Observation,
    PolicyEngine,
    PolicyParams,
)
from dynamo_snapshot.autoscale.prometheus import (
    InvalidQuery,
    MetricsUnavailable,
    NoData,
    NotOneSeries,
    PrometheusError,
    PrometheusSource,
    TickCache,
)
from dynamo_snapshot.autoscale.targets import Found, ScaleFailed, Targets
from dynamo_snapshot.kube import NORMAL, WARNING, EventRecorder, Informer, Kube, Obj, is_not_found
from dynamo_snapshot.kube.kinds import SCALING_POLICY
from dynamo_snapshot.kube.pods import pod_active, pod_ready

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "dynsnap_autoscale_decisions_total", "Autoscaler decisions that changed replicas", ["direction"]
)
EVALUATION_SECONDS = Histogram(
    "dynsnap_autoscale_evaluation_seconds",
    "Time to evaluate one policy (queries included)",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
)

METRICS_AVAILABLE = "MetricsAvailable"
SCALING_ACTIVE = "ScalingActive"
INVALID_SPEC = "InvalidSpec"
MAX_REPLICAS_CAPPED = "MaxReplicasCapped"
# A status carrying nothing new is written at most this often (its numbers still move every tick).
STATUS_REFRESH_S = 15.0
RESTORE_SAMPLES = 10
# An invalid spec cannot fix itself: its status is looked at again only this often (or on a new generation).
INVALID_RECHECK_S = 10.0


@dataclass
class _State:
    generation: int
    engine: PolicyEngine | None  # None while the spec is invalid
    next_due: float = 0.0
    last_status: dict[str, Any] = field(default_factory=dict)
    last_status_at: float = 0.0
    seeded: bool = False


class Autoscaler:
    """Runs while its process leads (see run_until); reads and writes the policies' targets through
    `targets`, and the policies' status and Events through `kube`."""

    def __init__(
        self,
        kube: Kube,
        *,
        targets: Targets,
        policies: Informer,
        recorder: EventRecorder,
        prometheus_url: str,
        max_policy_replicas: int,
        tick_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.targets = targets
        self.policies = policies
        self.recorder = recorder
        self.prometheus_url = prometheus_url
        self.max_policy_replicas = max_policy_replicas
        self.tick_s = tick_s
        self.clock = clock
        self._states: dict[str, _State] = {}
        self._sources: dict[tuple[str, float], PrometheusSource] = {}

    async def run_until(self, stop: asyncio.Event) -> None:
        await self.targets.open()
        try:
            while not stop.is_set():
                started = self.clock()
                await self.tick()
                delay = max(0.0, self.tick_s - (self.clock() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
        finally:
            # Their HTTP sessions' pooled connections; a new leader term opens fresh ones.
            for source in self._sources.values():
                source.close()
            self._sources.clear()
            await self.targets.close()

    async def tick(self) -> None:
        now = self.clock()
        keys = set(self.policies.keys())
        for gone in set(self._states) - keys:
            del self._states[gone]
        due = [k for k in keys if self._due(k, now)]
        if not due:
            return
        cache = TickCache()
        results = await asyncio.gather(*(self.evaluate(k, cache) for k in due), return_exceptions=True)
        for key, result in zip(due, results, strict=True):
            if isinstance(result, BaseException):
                log.error("autoscaler evaluation failed", extra={"policy": key, "error": repr(result)})

    def _due(self, key: str, now: float) -> bool:
        state = self._states.get(key)
        if state is None or state.next_due <= now:
            return True
        obj = self.policies.get(key)
        # A changed spec is looked at on the next tick, whatever the interval.
        return obj is not None and (Meta(obj).generation or 0) != state.generation

    def _source(self, spec: DynamoScalingPolicySpec) -> PrometheusSource:
        url = spec.prometheus_url or self.prometheus_url
        key = (url, float(spec.query_timeout_seconds))
        if key not in self._sources:
            self._sources[key] = PrometheusSource(url, timeout_s=float(spec.query_timeout_seconds))
        return self._sources[key]

    async def evaluate(self, key: str, cache: TickCache) -> Decision | None:
        obj = self.policies.get(key)
        if obj is None:
            return None
        started = self.clock()
        try:
            return await self._evaluate(key, obj, cache)
        finally:
            EVALUATION_SECONDS.observe(self.clock() - started)

    async def _evaluate(self, key: str, obj: Obj, cache: TickCache) -> Decision | None:
        view = ObjectView(obj)
        generation = view.meta.generation or 0
        status: dict[str, Any] = {"observedGeneration": generation}
        conditions: list[dict[str, Any]] = view.conditions
        checked = self._check_spec(key, obj, generation)
        if isinstance(checked, str):
            await self._finish(key, obj, status, conditions, invalid=checked)
            return None
        spec, state = checked
        conditions = cond.set_condition(conditions, INVALID_SPEC, False, "Valid", "spec is valid", generation)
        conditions = self._ceiling_condition(obj, spec, conditions, generation)
        ns, target = Meta(obj).namespace, spec.target
        found = self.targets.find(ns, target.dgd_name, target.service_name)
        if isinstance(found, str):
            conditions = self._target_problem(
                obj, conditions, ScaleFailed("TargetNotFound", f"{found} does not exist"), generation
            )
            await self._finish(key, obj, status, conditions)
            return None
        current = found.replicas
        engine = self._seeded_engine(state, current)

        pods = [p for p in self.targets.pods(ns, target.dgd_name, target.service_name) if pod_active(p)]
        ready = sum(1 for p in pods if pod_ready(p))
        wall = time.time()
        ages = tuple(wall - _created_at(p) for p in pods)
        samples, problems = await self._sample(spec, cache)
        decision = engine.decide(
            Observation(
                now=self.clock(),
                ready=ready,
                starting=len(pods) - ready,
                current_desired=current,
                metrics=samples,
                restore_latency_s=_restore_latency(pods),
                replica_ages_s=ages,
            )
        )
        conditions = _metrics_condition(conditions, problems, generation)
        status.update(
            desiredReplicas=decision.desired,
            readyReplicas=ready,
            startingReplicas=len(pods) - ready,
            lastMetrics={name: s.value if _usable(s.value) else None for name, s in samples.items()},
        )
        failed: ScaleFailed | None = None
        if decision.desired != current:
            try:
                await self._scale(obj, found, current, decision)
            except ScaleFailed as e:
                failed = e
            else:
                status["lastScaleTime"] = cond.now_rfc3339()
                current = decision.desired
        status["currentReplicas"] = current
        status["lastDecision"] = {
            "time": cond.now_rfc3339(),
            "desired": decision.desired,
            "reason": decision.reason[:1024],
            "panic": decision.panic,
        }
        conditions = _decision_conditions(conditions, decision, bool(problems), generation)
        if failed is not None:
            conditions = self._target_problem(obj, conditions, failed, generation)
        await self._finish(key, obj, status, conditions)
        return decision

    def _check_spec(
        self, key: str, obj: Obj, generation: int
    ) -> tuple[DynamoScalingPolicySpec, _State] | str:
        """The policy's spec and its evaluation state (a fresh engine for a new generation); what is wrong
        with the spec, in one line, when it is invalid."""
        try:
            policy = DynamoScalingPolicy.model_validate(obj)
            params = _params(policy.spec, self.max_policy_replicas)
        except (ValidationError, ValueError) as e:
            state = self._states.get(key)
            if state is None or state.generation != generation:
                state = self._states[key] = _State(generation, None)
            state.next_due = self.clock() + INVALID_RECHECK_S
            return validation_message(e) if isinstance(e, ValidationError) else str(e)
        state = self._states.get(key)
        if state is None or state.generation != generation or state.engine is None:
            state = self._states[key] = _State(generation, PolicyEngine(params))
        state.next_due = self.clock() + float(policy.spec.evaluation_interval_seconds)
        return policy.spec, state

    def _target_problem(
        self, obj: Obj, conditions: list[dict[str, Any]], problem: ScaleFailed, generation: int
    ) -> list[dict[str, Any]]:
        """Ready False for why the target cannot be found or written, and a Warning Event when that
        is news (not on every evaluation while it lasts)."""
        before = next((c for c in conditions if c.get("type") == cond.READY), None)
        if before is None or (before.get("reason"), before.get("message")) != (
            problem.reason,
            problem.message,
        ):
            self.recorder.record(obj, WARNING, problem.reason, problem.message)
            log.warning(
                "autoscaler target problem",
                extra={
                    "policy": Meta(obj).name,
                    "reason": problem.reason,
                    "detail": problem.message,
                },
            )
        return cond.set_condition(conditions, cond.READY, False, problem.reason, problem.message, generation)

    def _ceiling_condition(
        self, obj: Obj, spec: DynamoScalingPolicySpec, conditions: list[dict[str, Any]], generation: int
    ) -> list[dict[str, Any]]:
        """MaxReplicasCapped: True while maxReplicas is above the controller's ceiling, with a Warning
        Event when that is news (not on every evaluation while it lasts)."""
        ceiling = self.max_policy_replicas
        if spec.max_replicas <= ceiling:
            message = f"maxReplicas {spec.max_replicas} is within the controller's ceiling of {ceiling}"
            return cond.set_condition(
                conditions, MAX_REPLICAS_CAPPED, False, "WithinCeiling", message, generation
            )
        message = (
            f"maxReplicas {spec.max_replicas} is above the controller's cluster-wide ceiling "
            f"(--max-policy-replicas) of {ceiling}: the policy scales to at most {ceiling} replicas"
        )
        if spec.min_replicas > ceiling:
            message += f", and minReplicas {spec.min_replicas} counts as {ceiling}"
        before = next((c for c in conditions if c.get("type") == MAX_REPLICAS_CAPPED), None)
        if before is None or (before.get("status"), before.get("message")) != ("True", message):
            self.recorder.record(obj, WARNING, MAX_REPLICAS_CAPPED, message)
            log.warning(
                "policy capped to the replica ceiling",
                extra={"policy": Meta(obj).name, "detail": message},
            )
        return cond.set_condition(
            conditions, MAX_REPLICAS_CAPPED, True, "AboveClusterCeiling", message, generation
        )

    def _seeded_engine(self, state: _State, current: int) -> PolicyEngine:
        engine = state.engine
        assert engine is not None
        if not state.seeded:
            # No history after a restart or a spec change: the first scale-down waits a full window.
            engine.seed(self.clock(), current)
            state.seeded = True
        return engine

    async def _sample(
        self, spec: DynamoScalingPolicySpec, cache: TickCache
    ) -> tuple[dict[str, MetricSample], list[tuple[str, str]]]:
        """Each metric's value, None where it could not be had (which never lowers the count); a value
        that is not a finite number >= 0 is kept for the engine (which holds on it and names it) and
        reported as a problem."""
        source = self._source(spec)
        samples: dict[str, MetricSample] = {}
        problems: list[tuple[str, str]] = []
        for metric in spec.metrics:
            try:
                value: float | None = await cache.query(source, metric.query)
            except NoData:
                value = None
                problems.append(("NoData", f"{metric.name}: the query returned no data"))
            except (InvalidQuery, NotOneSeries) as e:
                value = None
                problems.append(("InvalidQuery", f"{metric.name}: {e}"))
            except MetricsUnavailable as e:
                value = None
                problems.append(("PrometheusUnavailable", f"{metric.name}: {e}"))
            except PrometheusError as e:
                value = None
                problems.append(("QueryFailed", f"{metric.name}: {e}"))
            else:
                if not _usable(value):
                    problems.append(
                        (
                            "UnusableValue",
                            f"{metric.name}: the query returned {value:g}; a total must be a finite "
                            "number >= 0, so it counts as missing",
                        )
                    )
            samples[metric.name] = MetricSample(value, 0.0)
        return samples, problems

    async def _scale(self, obj: Obj, found: Found, current: int, decision: Decision) -> None:
        svc, dgd = found.service, found.dgd
        await self.targets.scale(found, decision.desired)
        direction = "up" if decision.desired > current else "down"
        DECISIONS.labels(direction).inc()
        reason = "ScaledUp" if direction == "up" else "ScaledDown"
        message = f"service {svc}: {current} -> {decision.desired} replicas: {decision.reason}"
        if found.adapter is not None:
            message += f" (through {found.written})"
        self.recorder.record(obj, NORMAL, reason, message)
        self.recorder.record(dgd, NORMAL, reason, f"by DynamoScalingPolicy {Meta(obj).name}: {message}")
        log.info("scaled", extra={"policy": Meta(obj).name, "detail": message})

    async def _finish(
        self,
        key: str,
        obj: Obj,
        status: dict[str, Any],
        conditions: list[dict[str, Any]],
        *,
        invalid: str | None = None,
    ) -> None:
        generation = status.get("observedGeneration")
        if invalid is not None:
            conditions = cond.set_condition(
                conditions, INVALID_SPEC, True, "InvalidSpec", invalid, generation
            )
            conditions = cond.set_condition(conditions, cond.READY, False, "InvalidSpec", invalid, generation)
            self.recorder.record(obj, WARNING, "InvalidSpec", invalid)
        status["conditions"] = conditions
        state = self._states.get(key)
        now = self.clock()
        comparable = {k: v for k, v in status.items() if k != "lastDecision"} | {
            "reason": (status.get("lastDecision") or {}).get("reason")
        }
        if (
            state is not None
            and comparable == state.last_status
            and now - state.last_status_at < STATUS_REFRESH_S
        ):
            return
        try:
            await self.kube.json_patch(
                SCALING_POLICY,
                Meta(obj).name,
                _status_ops(obj, status),
                Meta(obj).namespace,
                subresource="status",
            )
        except Exception as e:
            if not is_not_found(e):
                raise
            return
        if state is not None:
            state.last_status, state.last_status_at = comparable, now


def _status_ops(obj: Obj, status: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch that writes `status`'s fields. Not a merge patch: that would delete lastMetrics'
    null entries (a metric without a usable value) instead of storing them, and keep the entries of
    metrics gone from the spec. A policy the cache shows without a status gets it whole (a field can only
    be added to an object that exists); its only writer is this autoscaler, so nothing else is lost."""
    if not ObjectView(obj).status:
        return [{"op": "add", "path": "/status", "value": status}]
    return [{"op": "add", "path": f"/status/{key}", "value": value} for key, value in status.items()]


def _metrics_condition(
    conditions: list[dict[str, Any]], problems: list[tuple[str, str]], generation: int
) -> list[dict[str, Any]]:
    if problems:
        reason, _ = problems[0]
        return cond.set_condition(
            conditions, METRICS_AVAILABLE, False, reason, "; ".join(m for _, m in problems), generation
        )
    return cond.set_condition(
        conditions, METRICS_AVAILABLE, True, "MetricsAvailable", "every query returned", generation
    )


def _decision_conditions(
    conditions: list[dict[str, Any]], decision: Decision, metrics_missing: bool, generation: int
) -> list[dict[str, Any]]:
    conditions = cond.set_condition(
        conditions,
        SCALING_ACTIVE,
        not decision.held,
        "Holding" if decision.held else "Active",
        decision.reason,
        generation,
    )
    return cond.set_condition(
        conditions,
        cond.READY,
        not metrics_missing,
        "MetricsUnavailable" if metrics_missing else "Ready",
        decision.reason,
        generation,
    )


def _usable(value: float | None) -> bool:
    """Whether a metric total can size a service: a finite number >= 0 (NaN, inf and negative totals
    say that the query is broken, not that the load is zero or endless)."""
    return value is not None and math.isfinite(value) and value >= 0


def _params(spec: DynamoScalingPolicySpec, ceiling: int) -> PolicyParams:
    return PolicyParams(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        metrics=tuple(MetricTarget(m.name, float(m.target_per_replica)) for m in spec.metrics),
        tolerance=float(spec.tolerance),
        scale_up_window_s=float(spec.scale_up.stabilization_window_seconds),
        scale_down_window_s=float(spec.scale_down.stabilization_window_seconds),
        scale_up_max_step=spec.scale_up.max_step,
        scale_up_max_percent=float(spec.scale_up.max_percent),
        scale_up_period_s=float(spec.scale_up.period_seconds),
        scale_down_max_step=spec.scale_down.max_step,
        scale_down_grace_s=float(spec.scale_down.grace_seconds),
        panic_window_s=float(spec.panic.window_seconds),
        panic_threshold=float(spec.panic.threshold),
        stale_after_s=float(spec.stale_after_seconds),
        replica_ceiling=ceiling,
    )


def _created_at(pod: Obj) -> float:
    stamp = Meta(pod).creation_timestamp
    if not stamp:
        return time.time()
    return cond.parse_rfc3339(stamp).timestamp()


def _restore_latency(pods: list[Obj]) -> float | None:
    """Median of the restore times the node agents reported on these pods (seconds), if any."""
    seen = []
    for pod in pods:
        raw = Meta(pod).annotations.get(protocol.ANNOTATION_RESTORE_TIMINGS)
        if not raw:
            continue
        try:
            phases = json.loads(raw)
            seen.append(sum(float(v) for v in phases.values()))
        except (ValueError, TypeError, AttributeError):
            continue
    return statistics.median(seen[-RESTORE_SAMPLES:]) if seen else None
