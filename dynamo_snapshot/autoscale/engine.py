"""The scaling policy engine: pure decision logic, no I/O, no asyncio, no Kubernetes.

The caller (the autoscaler loop) gathers an :class:`Observation` — the time, how many replicas serve and
how many are starting, the service's replica count, and one :class:`MetricSample` per configured metric —
and calls :meth:`PolicyEngine.decide`, which returns a :class:`Decision` with the new replica count and a
one-line reason for a Condition/Event. Time is passed in (``Observation.now``, seconds on any monotonic
clock), so the engine is deterministic and tests/simulations drive it without sleeping.

Metric convention: every metric value is the **service-wide total**, i.e. the query sums over the
replicas (e.g. ``sum(vllm:num_requests_waiting)``), and ``MetricTarget.target_per_replica`` is how much
of it one replica should carry. The proportional rule is then the HPA's ``AverageValue`` rule::

    wanted = ceil(current_capacity * value / (target * current_capacity)) = ceil(value / target)

with a tolerance band: when ``|value / (target * capacity) - 1| <= tolerance`` the capacity is kept.

The steps of one decision:

1. **Capacity** = ``ready + starting``. Replicas that are restoring or cold-starting are capacity already
   ordered; counting them means a burst observed for several ticks while they start does not keep adding
   replicas (the recommendation is an absolute count, not "ready + more").
2. **Per metric** proportional count (after the look-ahead below); the recommendation is the maximum over
   metrics, clamped to the bounds: ``[min_replicas, max_replicas]``, both cut to ``replica_ceiling`` (the
   cluster-wide ceiling of the controller) where that is lower.
3. **Missing or stale metrics** (``value is None``, a value that is not a finite number >= 0, or
   ``age_s > stale_after_s``) can never lower the count: if every metric is missing the engine holds
   ``current_desired`` (``held=True``; only step 7 may still move it); if only some are, the others are
   used but the result never goes below ``current_desired``. A service-wide total that is NaN, infinite
   or negative says the query is broken, not that the load is zero or endless.
4. **Panic** (Knative KPA style): when ``recommendation / ready >= panic_threshold`` (or nothing is ready
   and there is demand) the engine panics for ``panic_window_s`` (extended while the condition holds):
   it scales up towards the recommendation without waiting for the stabilization window, but within the
   scale-up rate limit of step 6 like any scale-up, and never scales down while panicking.
5. Otherwise **stabilization** (the HPA rule): a scale-up goes to the *lowest* recommendation seen within
   ``scale_up_window_s`` (0 = immediate), a scale-down to the *highest* recommendation seen within
   ``scale_down_window_s``.
6. **Rate limits**: up to at most ``B + max(scale_up_max_step, ceil(B * scale_up_max_percent / 100))``
   where ``B`` is the fewest replicas observed over the last ``scale_up_period_s`` (the HPA's scale-up
   rule, see :mod:`~dynamo_snapshot.autoscale.scale_up_limit`; there is no unlimited
   scale-up, so a query gone absurd moves the count by one step per period, not to the bound at once),
   down by at most ``scale_down_max_step`` per decision (0 = no limit), and never more replicas removed
   than are older
   than ``scale_down_grace_s`` (replica ages from ``Observation.replica_ages_s``; replicas counted in
   ``current_desired`` but absent from the ages — pods not created yet — are free to remove, so an empty
   tuple means "no ages known, no protection").
7. Final clamp to the bounds in every mode, held and panicking included (a changed min/max always takes
   effect, over the rate limits). The reason names what held a scale-up back: the rate limit (``at most
   +4 per 15s from 1``), ``max_replicas`` or ``cluster ceiling N``.

A metric's wanted count is at most ``2**31 - 1`` (what a Kubernetes replica count can hold), so a total
such as ``1e300`` asks for the most replicas there can be, which the rate limit and the bounds then
hold back, instead of an integer thousands of digits long or an overflow.

**Restore-aware look-ahead.** A replica ordered now serves only after its start latency, so the engine
sizes for the load expected *then*: for a rising metric it fits the slope of that metric's samples over
the last :data:`SLOPE_WINDOW_S` seconds (least squares) and uses ``value + slope * horizon``, never
below the current value and capped at ``2 * value``. The latency is the observed one
(``Observation.restore_latency_s``), else ``PolicyParams.restore_latency_s``, else
``PolicyParams.cold_start_latency_s``; the horizon is ``min(latency, LOOKAHEAD_CAP_S)``. With restore
(seconds) the look-ahead is short and the extrapolation accurate; with a cold start (minutes)
extrapolating a few seconds' slope that far is noise, hence the 30 s cap. No known latency means no
look-ahead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from dynamo_snapshot.autoscale.scale_up_limit import ScaleUpLimit

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

#: The look-ahead never extrapolates further than this many seconds (see the module docstring).
LOOKAHEAD_CAP_S = 30.0
#: The slope of a metric is fitted over its samples of the last this-many seconds.
SLOPE_WINDOW_S = 10.0

# Guards ceil() against float noise such as 30.000000000000004 / 10.
_EPS = 1e-9
# The most replicas a metric can ask for: the largest value of a Kubernetes int32 replica count.
_MOST_REPLICAS = 2**31 - 1


def _number_text(x: float) -> str:
    return f"{x:g}"


def _value_text(x: float) -> str:
    """A metric value for a reason: one decimal, or four significant digits where that would be long."""
    return f"{x:.1f}" if abs(x) < 1e6 else f"{x:.4g}"


@dataclass(frozen=True)
class MetricTarget:
    """A metric (service-wide total) and how much of it one replica should carry."""

    name: str
    target_per_replica: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("metric name must not be empty")
        if not (math.isfinite(self.target_per_replica) and self.target_per_replica > 0):
            raise ValueError(
                f"metric {self.name!r}: target_per_replica must be a finite number > 0, "
                f"got {self.target_per_replica!r}"
            )


@dataclass(frozen=True)
class PolicyParams:
    """The scaling policy. Defaults: immediate scale-up of at most max(4, 300%) replicas per 15 s, 60 s
    scale-down stabilization, one replica removed per decision, 30 s grace for new replicas, panic at 2x
    demand for 6 s, no cluster ceiling."""

    min_replicas: int
    max_replicas: int
    metrics: tuple[MetricTarget, ...]
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 60.0
    scale_up_max_step: int = 4
    scale_up_max_percent: float = 300.0
    scale_up_period_s: float = 15.0
    scale_down_max_step: int = 1
    scale_down_grace_s: float = 30.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    stale_after_s: float = 10.0
    restore_latency_s: float | None = None
    cold_start_latency_s: float | None = None
    replica_ceiling: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metrics, tuple):
            object.__setattr__(self, "metrics", tuple(self.metrics))
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        if not self.metrics:
            raise ValueError("at least one metric is required")
        seen: set[str] = set()
        for m in self.metrics:
            if not isinstance(m, MetricTarget):
                raise ValueError(f"metrics must be MetricTarget instances, got {m!r}")
            if not (math.isfinite(m.target_per_replica) and m.target_per_replica > 0):
                raise ValueError(f"metric {m.name!r}: target_per_replica must be > 0")
            if m.name in seen:
                raise ValueError(f"metric names must be unique: {m.name!r} appears more than once")
            seen.add(m.name)
        if not (0.0 <= self.tolerance < 1.0):
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        for name in (
            "scale_up_window_s",
            "scale_down_window_s",
            "scale_down_grace_s",
            "panic_window_s",
            "stale_after_s",
        ):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        # The scale-up limit's own checks, so that bad params fail here and not in the engine.
        ScaleUpLimit(self.scale_up_max_step, self.scale_up_max_percent, self.scale_up_period_s)
        if self.replica_ceiling is not None and self.replica_ceiling < 1:
            raise ValueError(f"replica_ceiling must be None or >= 1, got {self.replica_ceiling}")
        if self.scale_down_max_step < 0:
            raise ValueError(
                f"scale_down_max_step must be >= 0 (0 = unlimited), got {self.scale_down_max_step}"
            )
        if not (self.panic_threshold > 1.0):
            raise ValueError(
                f"panic_threshold must be > 1 (a desired/ready ratio; use inf to disable panic), "
                f"got {self.panic_threshold}"
            )
        for name in ("restore_latency_s", "cold_start_latency_s"):
            lat = getattr(self, name)
            if lat is not None and (math.isnan(lat) or lat < 0):
                raise ValueError(f"{name} must be None or >= 0, got {lat}")

    @property
    def upper(self) -> int:
        """The most replicas: max_replicas, or the cluster ceiling where that is lower."""
        if self.replica_ceiling is None:
            return self.max_replicas
        return min(self.max_replicas, self.replica_ceiling)

    @property
    def lower(self) -> int:
        """The fewest replicas: min_replicas, cut to ``upper``."""
        return min(self.min_replicas, self.upper)

    @property
    def upper_name(self) -> str:
        """What sets ``upper``, for a decision's reason."""
        if self.upper < self.max_replicas:
            return f"cluster ceiling {self.upper}"
        return "max_replicas"


@dataclass(frozen=True)
class MetricSample:
    """One metric reading: the service-wide total (``None`` = missing/unavailable) and its age."""

    value: float | None
    age_s: float = 0.0


@dataclass(frozen=True)
class Observation:
    """What the autoscaler sees at time ``now``.

    ``ready``: serving replicas. ``starting``: in-flight replicas (restoring or cold-starting), counted as
    capacity already ordered. ``current_desired``: the service's replica count now. ``metrics``: one sample
    per configured metric name (absent = missing). ``restore_latency_s``: the observed start latency of
    recent replicas, if known. ``replica_ages_s``: age of each existing replica (for the grace period).
    """

    now: float
    ready: int
    starting: int
    current_desired: int
    metrics: Mapping[str, MetricSample]
    restore_latency_s: float | None = None
    replica_ages_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("ready", "starting", "current_desired"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Decision:
    """The engine's answer.

    ``desired``: the replica count to set. ``reason``: one line for a Condition/Event. ``panic``: whether
    the engine is in panic mode. ``recommendation``: the clamped proportional count before stabilization
    and rate limits. ``per_metric``: each metric's wanted count (``None`` = missing/stale/unusable).
    ``held``: every metric was missing, stale or unusable, so the count was held (only moved into the
    bounds where it was outside).
    """

    desired: int
    reason: str
    panic: bool
    recommendation: int
    per_metric: dict[str, int | None] = field(default_factory=dict)
    held: bool = False


@dataclass(frozen=True)
class _MetricEstimate:
    name: str
    target: float
    value: float
    projected: float
    horizon_s: float
    wanted: int


class PolicyEngine:
    """Turns observations into replica counts; keeps the history the windows, panic and slope need.

    One engine per scaled service; feed it observations in time order.
    """

    def __init__(self, params: PolicyParams) -> None:
        self._params = params
        self._recommendations: deque[tuple[float, int]] = deque()
        self._samples: dict[str, deque[tuple[float, float]]] = {m.name: deque() for m in params.metrics}
        self._panic_until = -math.inf
        self._up_limit = ScaleUpLimit(
            params.scale_up_max_step, params.scale_up_max_percent, params.scale_up_period_s
        )

    @property
    def params(self) -> PolicyParams:
        return self._params

    # ------------------------------------------------------------------------------------------ decide
    def decide(self, obs: Observation) -> Decision:
        current = obs.current_desired
        self._up_limit.observe(obs.now, current)
        estimates, per_metric, missing = self._estimate(obs)
        if not estimates:
            return self._hold(obs, per_metric, missing)

        driver = max(estimates, key=lambda e: e.wanted)  # first of the maximal ones
        recommendation = self._clamp(driver.wanted)
        if missing:
            recommendation = max(recommendation, self._clamp(current))
        self._remember(obs.now, recommendation)

        # Panic (KPA): demand far above what is ready -> scale up without waiting, never down.
        ratio, triggered = self._demand(obs, recommendation, estimates)
        if triggered:
            self._panic_until = max(self._panic_until, obs.now + self._params.panic_window_s)
        notes = self._notes(driver, missing)
        if triggered or obs.now < self._panic_until:
            bounded = driver.wanted > self._params.upper
            return self._panic_decision(obs, recommendation, ratio, bounded, notes, per_metric)

        desired, qualifiers = self._stabilized(obs, recommendation)
        bound = self._params.upper_name
        if desired == self._params.upper < driver.wanted and bound not in qualifiers:
            qualifiers.append(bound)  # the bound, not the load, sets the count
        if desired > current:
            head = f"scale up {current} -> {desired}"
        elif desired < current:
            head = f"scale down {current} -> {desired}"
        else:
            head = f"steady at {current}"
        qual = f" ({', '.join(qualifiers)})" if qualifiers else ""
        return Decision(
            desired=desired,
            reason=f"{head}{qual}: {notes}",
            panic=False,
            recommendation=recommendation,
            per_metric=per_metric,
        )

    def _estimate(self, obs: Observation) -> tuple[list[_MetricEstimate], dict[str, int | None], list[str]]:
        """Each usable metric's wanted count (steps 1-3), the count per metric (None where it is missing)
        and why each missing one is."""
        p = self._params
        capacity = obs.ready + obs.starting
        horizon = self._horizon(obs)
        estimates: list[_MetricEstimate] = []
        per_metric: dict[str, int | None] = {}
        missing: list[str] = []
        for m in p.metrics:
            sample = obs.metrics.get(m.name)
            if sample is None or sample.value is None:
                per_metric[m.name] = None
                missing.append(f"{m.name} (no data)")
                continue
            if not (math.isfinite(sample.value) and sample.value >= 0):
                per_metric[m.name] = None
                missing.append(f"{m.name} (unusable value {_value_text(sample.value)})")
                continue
            if sample.age_s > p.stale_after_s:
                per_metric[m.name] = None
                missing.append(f"{m.name} (stale {_number_text(round(sample.age_s, 1))}s)")
                continue
            value = sample.value
            projected = self._look_ahead(m.name, obs.now - sample.age_s, value, horizon)
            wanted = self._proportional(projected, m.target_per_replica, capacity)
            per_metric[m.name] = wanted
            estimates.append(_MetricEstimate(m.name, m.target_per_replica, value, projected, horizon, wanted))
        return estimates, per_metric, missing

    def _hold(self, obs: Observation, per_metric: dict[str, int | None], missing: list[str]) -> Decision:
        """Every metric missing: keep the count, within the bounds."""
        current = obs.current_desired
        desired = self._clamp(current)
        if desired == current:
            head = f"hold {current}"
        else:
            bound = "min_replicas" if desired > current else self._params.upper_name
            head = f"scale {'up' if desired > current else 'down'} {current} -> {desired} ({bound})"
        return Decision(
            desired=desired,
            reason=f"{head}: metrics missing: {', '.join(missing)}",
            panic=obs.now < self._panic_until,
            recommendation=desired,
            per_metric=per_metric,
            held=True,
        )

    def _demand(
        self, obs: Observation, recommendation: int, estimates: list[_MetricEstimate]
    ) -> tuple[float, bool]:
        """The recommendation as a multiple of the ready replicas (inf with none ready), and whether that
        is enough to panic."""
        if obs.ready > 0:
            ratio = recommendation / obs.ready
            return ratio, ratio >= self._params.panic_threshold
        return math.inf, any(e.value > 0 for e in estimates) and recommendation > 0

    def _panic_decision(
        self,
        obs: Observation,
        recommendation: int,
        ratio: float,
        bounded: bool,
        notes: str,
        per_metric: dict[str, int | None],
    ) -> Decision:
        """Scale up without waiting, never down: no stabilization window, but the same rate limit as
        any scale-up, then the bounds (``bounded``: the upper bound cut the recommendation)."""
        p = self._params
        current = obs.current_desired
        wanted = max(current, recommendation)
        allowance = self._up_limit.allowance()
        limited = max(current, min(wanted, allowance.most))
        desired = self._clamp(limited)
        demand = f"demand {ratio:.1f}x ready capacity" if obs.ready > 0 else "demand with no ready capacity"
        held_back = f" ({allowance.text()})" if limited < wanted else ""
        if desired > current:
            action = f"scaling {current} -> {desired}"
            if desired > limited:
                action += " (min_replicas)"
            elif held_back:
                action += held_back
            elif bounded and desired == p.upper:
                action += f" ({p.upper_name})"
        elif desired < current:
            action = f"scaling {current} -> {desired} ({p.upper_name})"
        elif held_back:
            action = f"holding {desired}{held_back}"
        elif bounded and desired == p.upper:
            action = f"holding {desired} ({p.upper_name})"
        else:
            action = f"holding {desired} (no scale-down while panicking)"
        return Decision(
            desired=desired,
            reason=f"panic: {demand}, {action}: {notes}",
            panic=True,
            recommendation=recommendation,
            per_metric=per_metric,
        )

    def _stabilized(self, obs: Observation, recommendation: int) -> tuple[int, list[str]]:
        """Stabilization (HPA) and the rate limits (steps 5-7): up to the lowest recommendation of the up
        window, down to the highest of the down window. The count, and what held it back."""
        p = self._params
        current = obs.current_desired
        up_floor = min(r for t, r in self._recommendations if obs.now - t <= p.scale_up_window_s)
        down_ceiling = max(r for t, r in self._recommendations if obs.now - t <= p.scale_down_window_s)
        qualifiers: list[str] = []
        if up_floor > current:
            stabilized = up_floor
            if up_floor < recommendation:
                qualifiers.append(f"stabilized over {_number_text(p.scale_up_window_s)}s")
            allowance = self._up_limit.allowance()
            desired = max(current, min(stabilized, allowance.most))
            if desired < stabilized:
                qualifiers.append(allowance.text())
        elif down_ceiling < current:
            stabilized = down_ceiling
            qualifiers.append(f"stabilized over {_number_text(p.scale_down_window_s)}s")
            desired = stabilized
            if p.scale_down_max_step > 0 and current - desired > p.scale_down_max_step:
                desired = current - p.scale_down_max_step
                qualifiers.append(f"at most {p.scale_down_max_step} per step")
            removable = self._removable(obs)
            if current - desired > removable:
                desired = current - removable
                qualifiers.append(f"replicas younger than {_number_text(p.scale_down_grace_s)}s protected")
        else:
            desired = current
            if recommendation > current:
                qualifiers.append(f"recommendation {recommendation} held back by the scale-up window")
            elif recommendation < current:
                qualifiers.append(
                    f"recommendation {recommendation} held back by the "
                    f"{_number_text(p.scale_down_window_s)}s scale-down window"
                )
        clamped = self._clamp(desired)
        if clamped != desired:
            qualifiers.append("min_replicas" if clamped > desired else p.upper_name)
            desired = clamped
        return desired, qualifiers

    # ----------------------------------------------------------------------------------------- helpers
    def _clamp(self, n: int) -> int:
        return max(self._params.lower, min(self._params.upper, n))

    def _proportional(self, value: float, target: float, capacity: int) -> int:
        if capacity > 0 and abs(value / (target * capacity) - 1.0) <= self._params.tolerance + _EPS:
            return capacity
        wanted = value / target - _EPS
        if not wanted < _MOST_REPLICAS:  # also an overflow to inf
            return _MOST_REPLICAS
        return max(0, math.ceil(wanted))

    def _horizon(self, obs: Observation) -> float:
        p = self._params
        latency = obs.restore_latency_s
        if latency is None:
            latency = p.restore_latency_s
        if latency is None:
            latency = p.cold_start_latency_s
        if latency is None or not math.isfinite(latency) or latency <= 0:
            return 0.0
        return min(latency, LOOKAHEAD_CAP_S)

    def _look_ahead(self, name: str, sampled_at: float, value: float, horizon: float) -> float:
        """Record the sample; return the value expected ``horizon`` seconds on (never below ``value``,
        at most ``2 * value``)."""
        history = self._samples[name]
        if not history or sampled_at > history[-1][0] + 1e-6:
            history.append((sampled_at, value))
        elif abs(sampled_at - history[-1][0]) <= 1e-6:
            history[-1] = (sampled_at, value)  # the same scrape seen again
        while history and history[0][0] < sampled_at - SLOPE_WINDOW_S:
            history.popleft()
        if horizon <= 0 or len(history) < 2 or value <= 0:
            return value
        n = len(history)
        mean_t = sum(t for t, _ in history) / n
        mean_v = sum(v for _, v in history) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in history)
        if var_t <= 0:
            return value
        slope = sum((t - mean_t) * (v - mean_v) for t, v in history) / var_t
        # Totals near the float limit overflow the sums to inf and the slope to NaN: no look-ahead then.
        if not (math.isfinite(slope) and slope > 0):
            return value
        projected = min(value + slope * horizon, 2.0 * value)
        return projected if math.isfinite(projected) else value

    def seed(self, now: float, current: int) -> None:
        """Count `current` as recommended at `now`, so that a fresh engine (a new policy or spec, a
        restarted controller) waits a whole scale-down window before it removes anything."""
        self._remember(now, self._clamp(current))
        self._up_limit.observe(now, current)

    def _remember(self, now: float, recommendation: int) -> None:
        self._recommendations.append((now, recommendation))
        keep = max(self._params.scale_up_window_s, self._params.scale_down_window_s)
        while self._recommendations and now - self._recommendations[0][0] > keep:
            self._recommendations.popleft()

    def _removable(self, obs: Observation) -> int:
        """Replicas the grace period lets go: those older than the grace, plus replicas in
        ``current_desired`` that have no age (not created yet)."""
        old = sum(1 for age in obs.replica_ages_s if age >= self._params.scale_down_grace_s)
        return old + max(0, obs.current_desired - len(obs.replica_ages_s))

    @staticmethod
    def _notes(driver: _MetricEstimate, missing: list[str]) -> str:
        value, projected = _value_text(driver.value), _value_text(driver.projected)
        rising = f" rising to {projected} in {_number_text(driver.horizon_s)}s" if projected != value else ""
        target = _number_text(driver.target)
        text = f"{driver.name} {value}{rising} (target {target}/replica) wants {driver.wanted}"
        if missing:
            text += f"; missing, not scaling below current: {', '.join(missing)}"
        return text
