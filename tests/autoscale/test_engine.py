"""The scaling policy engine: pure logic, driven with explicit timestamps (no sleeping, no cluster)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_snapshot.autoscale import (
    Decision,
    MetricSample,
    MetricTarget,
    Observation,
    PolicyEngine,
    PolicyParams,
)

WAITING = "vllm:num_requests_waiting"
KV = "vllm:kv_cache_usage_perc"
MOST = 2**31 - 1  # the largest replica count Kubernetes can hold


def params(**kw: Any) -> PolicyParams:
    """Defaults made neutral so each test switches on only the behaviour it checks."""
    base: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 50,
        "metrics": (MetricTarget(WAITING, 10.0),),
        "scale_down_grace_s": 0.0,
        "panic_threshold": math.inf,
        # A step no service reaches: the scale-up rate limit is off unless a test sets it.
        "scale_up_max_step": MOST,
    }
    base.update(kw)
    return PolicyParams(**base)


def obs(
    now: float,
    current: int,
    waiting: float | None,
    *,
    ready: int | None = None,
    starting: int = 0,
    age: float = 0.0,
    extra: dict[str, MetricSample] | None = None,
    restore: float | None = None,
    ages: tuple[float, ...] = (),
) -> Observation:
    metrics = {WAITING: MetricSample(waiting, age)}
    metrics.update(extra or {})
    return Observation(
        now=now,
        ready=current - starting if ready is None else ready,
        starting=starting,
        current_desired=current,
        metrics=metrics,
        restore_latency_s=restore,
        replica_ages_s=ages,
    )


# ------------------------------------------------------------------------------------ proportional math
def test_scale_up_proportional_and_reason() -> None:
    d = PolicyEngine(params()).decide(obs(0, 2, 46.0))
    assert d.desired == 5
    assert d.recommendation == 5
    assert d.per_metric == {WAITING: 5}
    assert not d.panic
    assert not d.held
    assert d.reason.startswith("scale up 2 -> 5: vllm:num_requests_waiting 46.0 (target 10/replica) wants 5")


def test_exact_multiple_does_not_round_up_on_float_noise() -> None:
    # 0.1 * 3 * 100 is 30.000000000000004 in floating point
    d = PolicyEngine(params(tolerance=0.0)).decide(obs(0, 1, 0.1 * 3 * 100))
    assert d.desired == 3


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        (30.0, 3),  # exactly on target
        (32.9, 3),  # +9.7% : inside the 10% tolerance
        (27.1, 3),  # -9.7% : inside
        (34.0, 4),  # +13%  : outside -> ceil(3.4)
        (33.0, 3),  # +10%  : on the boundary counts as inside
    ],
)
def test_tolerance_band_keeps_capacity(waiting: float, expected: int) -> None:
    d = PolicyEngine(params(scale_down_window_s=0.0, scale_down_max_step=0)).decide(obs(0, 3, waiting))
    assert d.desired == expected


def test_tolerance_uses_capacity_including_starting() -> None:
    # 52 waiting, capacity 2 ready + 3 starting = 5 -> ratio 1.04, inside tolerance: keep 5 (not 6)
    d = PolicyEngine(params()).decide(obs(0, 5, 52.0, ready=2, starting=3))
    assert d.desired == 5
    assert d.per_metric[WAITING] == 5


def test_max_over_metrics() -> None:
    p = params(metrics=(MetricTarget(WAITING, 10.0), MetricTarget(KV, 0.5)))
    d = PolicyEngine(p).decide(obs(0, 2, 25.0, extra={KV: MetricSample(3.1, 0.0)}))
    assert d.per_metric == {WAITING: 3, KV: 7}
    assert d.desired == 7
    assert KV in d.reason


def test_min_max_clamps() -> None:
    eng = PolicyEngine(params(min_replicas=2, max_replicas=6, scale_down_window_s=0, scale_down_max_step=0))
    up = eng.decide(obs(0, 3, 500.0))
    assert up.desired == 6
    assert up.recommendation == 6
    assert up.per_metric[WAITING] == 50  # the metric's own wish is reported unclamped
    down = eng.decide(obs(1, 6, 0.0))
    assert down.desired == 2
    # below min (e.g. min raised): goes up to min even with no load
    assert PolicyEngine(params(min_replicas=3)).decide(obs(0, 1, 0.0)).desired == 3
    # above max (e.g. max lowered): goes down to max regardless of step limits
    assert PolicyEngine(params(max_replicas=4)).decide(obs(0, 9, 200.0)).desired == 4


def test_zero_min_allows_scale_to_zero() -> None:
    eng = PolicyEngine(params(min_replicas=0, scale_down_window_s=0))
    assert eng.decide(obs(0, 1, 0.0)).desired == 0


# ----------------------------------------------------------------------------------------- in-flight
def test_in_flight_replicas_count_as_capacity() -> None:
    """A burst observed for several ticks while replicas start does not keep adding replicas."""
    eng = PolicyEngine(params())
    first = eng.decide(obs(0, 2, 80.0, ready=2))
    assert first.desired == 8
    for t in range(1, 6):  # the same burst, 6 replicas restoring
        d = eng.decide(obs(t, 8, 80.0, ready=2, starting=6))
        assert d.desired == 8, d.reason
    assert eng.decide(obs(6, 8, 80.0, ready=8)).desired == 8


# --------------------------------------------------------------------------------------- stabilization
def test_scale_down_uses_max_recommendation_in_window() -> None:
    eng = PolicyEngine(params(scale_down_window_s=60.0, scale_down_max_step=0))
    assert eng.decide(obs(0, 6, 60.0)).desired == 6
    # load drops: the 60 s window still remembers 6
    for t in (10, 30, 59):
        d = eng.decide(obs(t, 6, 20.0))
        assert d.desired == 6, d.reason
        assert d.recommendation == 2
        assert "held back" in d.reason
    d = eng.decide(obs(61, 6, 20.0))
    assert d.desired == 2
    assert d.reason.startswith("scale down 6 -> 2 (stabilized over 60s)")


def test_scale_down_goes_to_highest_recent_recommendation() -> None:
    eng = PolicyEngine(params(scale_down_window_s=30.0, scale_down_max_step=0))
    eng.decide(obs(0, 8, 80.0))
    eng.decide(obs(10, 8, 50.0))
    eng.decide(obs(20, 8, 30.0))
    # at t=35 the window [5, 35] holds 5, 3 and now 2 -> down to 5
    assert eng.decide(obs(35, 8, 20.0)).desired == 5


def test_scale_up_window_uses_min_recommendation() -> None:
    eng = PolicyEngine(params(scale_up_window_s=30.0))
    assert eng.decide(obs(0, 2, 20.0)).desired == 2
    d = eng.decide(obs(10, 2, 100.0))
    assert d.desired == 2  # the window still holds 2
    assert d.recommendation == 10
    assert eng.decide(obs(20, 2, 60.0)).desired == 2
    # at t=31 the window [1, 31] holds 10, 6 and 8 -> up to the lowest, 6
    d = eng.decide(obs(31, 2, 80.0))
    assert d.desired == 6
    assert "stabilized over 30s" in d.reason


def test_scale_up_immediate_by_default() -> None:
    eng = PolicyEngine(params())
    eng.decide(obs(0, 2, 20.0))
    assert eng.decide(obs(2, 2, 90.0)).desired == 9


# -------------------------------------------------------------------------------------------- rate limits
def test_scale_down_step_limit() -> None:
    eng = PolicyEngine(params(scale_down_window_s=60.0, scale_down_max_step=1))
    eng.decide(obs(0, 6, 60.0))
    d = eng.decide(obs(61, 6, 10.0))
    assert d.desired == 5
    assert d.reason.startswith("scale down 6 -> 5 (stabilized over 60s, at most 1 per step)")
    assert eng.decide(obs(63, 5, 10.0)).desired == 4


def test_scale_up_step_and_percent_limit_per_period() -> None:
    # max(4, 100% of 2) = 4 -> 2 -> 6, then nothing more while the 2 is less than 15 s old
    eng = PolicyEngine(params(scale_up_max_step=4, scale_up_max_percent=100.0))
    d = eng.decide(obs(0, 2, 300.0))
    assert d.desired == 6
    assert d.reason.startswith("scale up 2 -> 6 (at most +4 per 15s from 2): ")
    for t in (2, 8, 14.9):
        d = eng.decide(obs(t, 6, 300.0))
        assert d.desired == 6
        assert d.reason.startswith("steady at 6 (at most +4 per 15s from 2): ")
    # a new period from 6: max(4, 100% of 6) = 6 -> 12
    d = eng.decide(obs(15, 6, 300.0))
    assert d.desired == 12
    assert d.reason.startswith("scale up 6 -> 12 (at most +6 per 15s from 6): ")
    # 50%: max(1, ceil(5 * 0.5)) = 3
    eng2 = PolicyEngine(params(scale_up_max_step=1, scale_up_max_percent=50.0))
    assert eng2.decide(obs(0, 5, 300.0)).desired == 8


def test_the_period_starts_from_the_fewest_replicas_seen() -> None:
    eng = PolicyEngine(params(scale_up_max_step=4, scale_up_max_percent=100.0, scale_down_max_step=0))
    assert eng.decide(obs(0, 1, 1000.0)).desired == 5
    # The write not seen yet (a lagging cache): the same limit again, not a second step on top.
    assert eng.decide(obs(2, 1, 1000.0)).desired == 5
    assert eng.decide(obs(4, 5, 1000.0)).desired == 5
    # The period runs from the last time 1 was seen (t=2).
    assert eng.decide(obs(16.9, 5, 1000.0)).desired == 5
    assert eng.decide(obs(17, 5, 1000.0)).desired == 10
    # Replicas removed inside a period lower its start: 10 -> 3 by hand, then up by max(4, 3) only.
    eng = PolicyEngine(params(scale_up_max_step=4, scale_up_max_percent=100.0))
    eng.decide(obs(0, 10, 100.0))
    assert eng.decide(obs(2, 3, 1000.0)).desired == 7


def test_the_default_limit_moves_an_absurd_total_one_step_per_period() -> None:
    """A policy on vector(1e300) with no scaleUp settings: +4 (or +300%) per 15 s, panic or not."""
    p = PolicyParams(min_replicas=1, max_replicas=MOST, metrics=(MetricTarget(WAITING, 10.0),))
    eng = PolicyEngine(p)
    current, changes = 1, []
    for t in range(0, 61, 2):  # every 2 s, the default interval, for a minute
        d = eng.decide(obs(float(t), current, 1e300, ready=1, starting=current - 1))
        assert d.panic, d.reason
        if d.desired != current:
            changes.append((t, current, d.desired))
        current = d.desired
    assert changes == [(0, 1, 5), (16, 5, 20), (32, 20, 80), (48, 80, 320)]
    first = PolicyEngine(p).decide(obs(0, 1, 1e300))
    assert first.reason.startswith(
        "panic: demand 2147483647.0x ready capacity, scaling 1 -> 5 (at most +4 per 15s from 1): "
    )


# ------------------------------------------------------------------------------- the cluster ceiling
def test_the_cluster_ceiling_bounds_every_mode_and_is_named() -> None:
    capped = params(max_replicas=100, replica_ceiling=8, scale_down_window_s=0, scale_down_max_step=0)
    d = PolicyEngine(capped).decide(obs(0, 2, 1e300))
    assert (d.desired, d.recommendation, d.panic) == (8, 8, False)
    assert d.per_metric == {WAITING: MOST}
    assert d.reason.startswith("scale up 2 -> 8 (cluster ceiling 8): ")
    d = PolicyEngine(dataclasses.replace(capped, panic_threshold=2.0)).decide(obs(0, 2, 1e300))
    assert (d.desired, d.panic) == (8, True)
    assert d.reason.startswith("panic: demand 4.0x ready capacity, scaling 2 -> 8 (cluster ceiling 8): ")
    # A service above the ceiling (set by hand, or a ceiling lowered) comes down to it, held or not.
    d = PolicyEngine(capped).decide(obs(0, 12, 1e300))
    assert d.desired == 8
    assert d.reason.startswith("scale down 12 -> 8 (stabilized over 0s, cluster ceiling 8): ")
    stepped = dataclasses.replace(capped, scale_down_max_step=1)
    d = PolicyEngine(stepped).decide(obs(0, 12, 1e300))
    assert d.reason.startswith(
        "scale down 12 -> 8 (stabilized over 0s, at most 1 per step, cluster ceiling 8): "
    )
    d = PolicyEngine(capped).decide(obs(0, 12, None))
    assert d.reason.startswith("scale down 12 -> 8 (cluster ceiling 8): metrics missing: ")
    # The ceiling cuts min_replicas too.
    d = PolicyEngine(params(min_replicas=10, max_replicas=20, replica_ceiling=8)).decide(obs(0, 3, 0.0))
    assert d.desired == 8


def test_max_replicas_is_named_where_it_is_the_lower_bound() -> None:
    d = PolicyEngine(params(max_replicas=6, replica_ceiling=8)).decide(obs(0, 2, 1e300))
    assert d.desired == 6
    assert d.reason.startswith("scale up 2 -> 6 (max_replicas): ")
    # Neither is named when the load wants no more than the bound.
    d = PolicyEngine(params(max_replicas=6, replica_ceiling=8)).decide(obs(0, 2, 60.0))
    assert d.reason.startswith("scale up 2 -> 6: ")


def test_the_rate_limit_and_the_ceiling_together() -> None:
    eng = PolicyEngine(params(max_replicas=MOST, replica_ceiling=8, scale_up_max_step=4))
    assert eng.decide(obs(0, 1, 1e300)).reason.startswith("scale up 1 -> 5 (at most +4 per 15s from 1): ")
    d = eng.decide(obs(15, 5, 1e300))
    assert d.desired == 8  # the period allows 20
    assert d.reason.startswith("scale up 5 -> 8 (cluster ceiling 8): ")
    # Held there, and the reason says by what, in either mode.
    d = eng.decide(obs(17, 8, 1e300))
    assert (d.desired, d.panic) == (8, False)
    assert d.reason.startswith("steady at 8 (cluster ceiling 8): ")
    panicking = PolicyEngine(params(max_replicas=MOST, replica_ceiling=8, panic_threshold=2.0))
    d = panicking.decide(obs(0, 8, 1e300, ready=2, starting=6))
    assert (d.desired, d.panic) == (8, True)
    assert d.reason.startswith("panic: demand 4.0x ready capacity, holding 8 (cluster ceiling 8): ")


# ------------------------------------------------------------------------------------------ grace period
def test_grace_period_protects_young_replicas() -> None:
    eng = PolicyEngine(
        params(scale_down_window_s=0.0, scale_down_max_step=0, scale_down_grace_s=30.0, min_replicas=1)
    )
    # 5 replicas, only 2 older than 30 s: at most 2 can go although load wants 1
    d = eng.decide(obs(0, 5, 5.0, ages=(100.0, 45.0, 20.0, 10.0, 1.0)))
    assert d.desired == 3
    assert "younger than 30s protected" in d.reason
    # all young -> nothing removed
    assert eng.decide(obs(1, 3, 5.0, ages=(5.0, 4.0, 3.0))).desired == 3
    # replicas counted in current_desired without an age (not created yet) are free to remove
    assert eng.decide(obs(2, 5, 5.0, ages=(5.0, 4.0, 3.0))).desired == 3


def test_grace_period_default_protects() -> None:
    p = PolicyParams(min_replicas=1, max_replicas=10, metrics=(MetricTarget(WAITING, 10.0),))
    assert p.scale_down_grace_s == 30.0
    eng = PolicyEngine(p)
    eng.decide(obs(0, 4, 0.0, ages=(10.0,) * 4))
    d = eng.decide(obs(100, 4, 0.0, ages=(29.9,) * 4))
    assert d.desired == 4


# ---------------------------------------------------------------------------------- missing / stale
def test_all_metrics_missing_holds() -> None:
    p = params(metrics=(MetricTarget(WAITING, 10.0), MetricTarget(KV, 0.5)))
    d = PolicyEngine(p).decide(obs(0, 3, None))
    assert d.held
    assert d.desired == 3
    assert d.per_metric == {WAITING: None, KV: None}
    assert d.reason == (
        "hold 3: metrics missing: vllm:num_requests_waiting (no data), vllm:kv_cache_usage_perc (no data)"
    )


def test_missing_metric_reason_names_it() -> None:
    p = params(metrics=(MetricTarget(KV, 0.5),))
    d = PolicyEngine(p).decide(obs(0, 3, 0.0))
    assert d.reason == "hold 3: metrics missing: vllm:kv_cache_usage_perc (no data)"


def test_stale_metric_is_treated_as_missing() -> None:
    eng = PolicyEngine(params(stale_after_s=10.0, scale_down_window_s=0))
    d = eng.decide(obs(0, 6, 0.0, age=12.5))
    assert d.held
    assert d.desired == 6
    assert "stale 12.5s" in d.reason
    # also a stale high value does not scale up
    assert eng.decide(obs(1, 6, 500.0, age=11.0)).desired == 6


def test_partial_missing_never_scales_down_but_can_scale_up() -> None:
    p = params(metrics=(MetricTarget(WAITING, 10.0), MetricTarget(KV, 0.5)), scale_down_window_s=0)
    eng = PolicyEngine(p)
    d = eng.decide(obs(0, 6, 10.0))  # KV missing, WAITING wants 1
    assert d.desired == 6
    assert not d.held
    assert "missing" in d.reason
    d = eng.decide(obs(1, 6, 90.0))  # WAITING wants 9: allowed to go up
    assert d.desired == 9


@settings(max_examples=200, deadline=None)
@given(
    current=st.integers(1, 40),
    values=st.lists(st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)), min_size=2, max_size=2),
    missing_idx=st.integers(0, 1),
    stale=st.booleans(),
)
def test_missing_or_stale_never_scales_down(
    current: int, values: list[float | None], missing_idx: int, stale: bool
) -> None:
    p = params(
        metrics=(MetricTarget(WAITING, 10.0), MetricTarget(KV, 0.5)),
        scale_down_window_s=0,
        scale_down_max_step=0,
    )
    samples = {
        WAITING: MetricSample(values[0], 0.0),
        KV: MetricSample(values[1], 0.0),
    }
    name = (WAITING, KV)[missing_idx]
    samples[name] = MetricSample(500.0, 60.0) if stale else MetricSample(None, 0.0)
    o = Observation(now=0, ready=current, starting=0, current_desired=current, metrics=samples)
    assert PolicyEngine(p).decide(o).desired >= current


# ----------------------------------------------------------------------------------------------- panic
def test_panic_scales_up_at_once_ignoring_the_window() -> None:
    eng = PolicyEngine(params(panic_threshold=2.0, scale_up_window_s=60.0))
    eng.decide(obs(0, 2, 20.0))
    d = eng.decide(obs(1, 2, 80.0))
    assert d.panic
    assert d.desired == 8
    assert d.reason.startswith("panic: demand 4.0x ready capacity, scaling 2 -> 8: ")


def test_panic_keeps_the_scale_up_rate_limit() -> None:
    p = params(panic_threshold=2.0, scale_up_window_s=60.0, scale_up_max_step=1, scale_up_max_percent=50)
    eng = PolicyEngine(p)
    eng.decide(obs(0, 2, 20.0))
    d = eng.decide(obs(1, 2, 80.0))
    assert d.panic
    assert d.desired == 3  # max(1, ceil(2 * 50%)) added, not the 6 the panic wants
    assert d.reason.startswith(
        "panic: demand 4.0x ready capacity, scaling 2 -> 3 (at most +1 per 15s from 2): "
    )
    # Still panicking, but the period that started from 2 allows no more.
    d = eng.decide(obs(3, 3, 80.0, ready=2, starting=1))
    assert (d.panic, d.desired) == (True, 3)
    assert d.reason.startswith("panic: demand 4.0x ready capacity, holding 3 (at most +1 per 15s from 2): ")
    d = eng.decide(obs(16, 3, 80.0, ready=2, starting=1))
    assert (d.panic, d.desired) == (True, 5)  # + max(1, ceil(3 * 50%)) in the next period


def test_panic_never_scales_down() -> None:
    p = params(panic_threshold=2.0, panic_window_s=6.0, scale_down_window_s=0.0, scale_down_max_step=0)
    eng = PolicyEngine(p)
    assert eng.decide(obs(0, 2, 80.0)).panic
    # load gone, but still inside the panic window: no scale-down
    for t in (1, 3, 5.9):
        d = eng.decide(obs(t, 8, 0.0, ready=2, starting=6))
        assert d.panic
        assert d.desired == 8
        assert "no scale-down while panicking" in d.reason
    d = eng.decide(obs(6.5, 8, 0.0))
    assert not d.panic
    assert d.desired == 1


def test_panic_window_extends_while_condition_holds() -> None:
    eng = PolicyEngine(params(panic_threshold=2.0, panic_window_s=6.0, scale_down_window_s=0))
    eng.decide(obs(0, 2, 80.0))
    eng.decide(obs(5, 8, 80.0, ready=2, starting=6))  # still 4x ready: re-triggers until 11
    d = eng.decide(obs(10, 8, 0.0, ready=8))
    assert d.panic
    assert d.desired == 8


def test_panic_with_nothing_ready() -> None:
    eng = PolicyEngine(params(min_replicas=0, panic_threshold=2.0))
    d = eng.decide(obs(0, 0, 35.0))
    assert d.panic
    assert d.desired == 4
    assert d.reason.startswith("panic: demand with no ready capacity, scaling 0 -> 4")
    limited = PolicyEngine(params(min_replicas=0, panic_threshold=2.0, scale_up_max_step=1))
    d = limited.decide(obs(0, 0, 35.0))
    assert (d.panic, d.desired) == (True, 1)
    # no demand, nothing ready: no panic
    assert not PolicyEngine(params(min_replicas=0, panic_threshold=2.0)).decide(obs(0, 0, 0.0)).panic


def test_below_threshold_is_not_panic() -> None:
    eng = PolicyEngine(params(panic_threshold=2.0))
    d = eng.decide(obs(0, 4, 70.0))  # 7 / 4 = 1.75x
    assert not d.panic
    assert d.desired == 7


@settings(max_examples=150, deadline=None)
@given(loads=st.lists(st.floats(0, 400, allow_nan=False), min_size=1, max_size=30))
def test_panic_decisions_never_lower_the_count(loads: list[float]) -> None:
    eng = PolicyEngine(PolicyParams(min_replicas=1, max_replicas=40, metrics=(MetricTarget(WAITING, 10.0),)))
    current = 1
    for i, load in enumerate(loads):
        d = eng.decide(
            obs(float(i), current, load, ready=max(1, current // 2), starting=current - max(1, current // 2))
        )
        if d.panic:
            assert d.desired >= current
        assert 1 <= d.desired <= 40
        current = d.desired


# ---------------------------------------------------------------------------------------- look-ahead
def _ramp(eng: PolicyEngine, restore: float | None, current: int = 10) -> Decision:
    d = None
    for t in range(0, 6):  # waiting rises 10 per second: 50, 60, ... 100
        d = eng.decide(obs(float(t), current, 50.0 + 10.0 * t, restore=restore))
    assert d is not None
    return d


def test_look_ahead_raises_count_for_rising_metric() -> None:
    without = _ramp(PolicyEngine(params(tolerance=0.0)), restore=None)
    assert without.desired == 10  # 100 waiting / 10
    with_restore = _ramp(PolicyEngine(params(tolerance=0.0)), restore=5.0)
    # slope 10/s, 5 s ahead: 100 + 50 = 150 -> 15
    assert with_restore.desired == 15
    assert "rising to 150.0 in 5s" in with_restore.reason


def test_look_ahead_uses_params_latency_and_caps_horizon() -> None:
    # observed latency wins over params
    assert _ramp(PolicyEngine(params(tolerance=0.0, restore_latency_s=60.0)), restore=2.0).desired == 12
    # params restore latency when nothing observed
    assert _ramp(PolicyEngine(params(tolerance=0.0, restore_latency_s=3.0)), restore=None).desired == 13
    # a cold start of 300 s: horizon capped at 30 s, and the extrapolation at 2x the value
    d = _ramp(PolicyEngine(params(tolerance=0.0, cold_start_latency_s=300.0)), restore=None)
    assert d.desired == 20  # min(100 + 10 * 30, 2 * 100) / 10


def test_look_ahead_never_lowers_for_falling_metric() -> None:
    eng = PolicyEngine(params(tolerance=0.0, scale_down_window_s=0, scale_down_max_step=0))
    d = None
    for t in range(0, 6):
        d = eng.decide(obs(float(t), 10, 100.0 - 10.0 * t, restore=5.0))
    assert d is not None
    assert d.desired == 5  # exactly the current value's count, no extrapolation downwards
    assert "rising" not in d.reason


def test_look_ahead_ignores_repeated_scrape() -> None:
    """The same scrape seen on several ticks (age growing) is one sample, so it makes no slope."""
    eng = PolicyEngine(params(tolerance=0.0))
    d = None
    for t in range(0, 5):
        d = eng.decide(obs(float(t), 5, 50.0, age=float(t), restore=5.0))
    assert d is not None
    assert d.desired == 5


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(0, 500, allow_nan=False), min_size=1, max_size=15),
    latency=st.floats(0.5, 200),
)
def test_look_ahead_never_lowers_the_recommendation(values: list[float], latency: float) -> None:
    plain = PolicyEngine(params())
    ahead = PolicyEngine(params())
    for i, v in enumerate(values):
        a = plain.decide(obs(float(i), 5, v))
        b = ahead.decide(obs(float(i), 5, v, restore=latency))
        assert b.recommendation >= a.recommendation
        assert b.recommendation <= max(
            a.recommendation, PolicyEngine(params()).decide(obs(0, 5, 2 * v)).recommendation
        )


# ------------------------------------------------------------------ absurd and unusable metric values
# Each unusable total and how a reason shows it.
SHOWN = {math.inf: "inf", -math.inf: "-inf", math.nan: "nan", -5.0: "-5.0", -1e300: "-1e+300"}
UNUSABLE = list(SHOWN)
LIMITS: dict[str, dict[str, Any]] = {
    "no-rate-limits": {"scale_down_max_step": 0},
    # A 1 s period: these tests decide once a second, so each decision may take one step.
    "rate-limits": {
        "scale_up_max_step": 1,
        "scale_up_max_percent": 50.0,
        "scale_up_period_s": 1.0,
        "scale_down_max_step": 1,
    },
}
MODES = ["normal", "panic"]


def _engine(mode: str, limits: str, **kw: Any) -> PolicyEngine:
    threshold = 2.0 if mode == "panic" else math.inf
    return PolicyEngine(params(panic_threshold=threshold, scale_down_window_s=0.0, **LIMITS[limits], **kw))


def _panicking(eng: PolicyEngine) -> int:
    """Put the engine in panic (80 waiting on 2 ready replicas); the replicas it set."""
    d = eng.decide(obs(0, 2, 80.0))
    assert d.panic
    return d.desired


def _within_policy(eng: PolicyEngine, current: int, d: Decision) -> None:
    """The invariants of every decision: the bounds, and the scale-up rate limit above min_replicas
    (decisions one period apart: each may add one step to the current count)."""
    p = eng.params
    assert p.lower <= d.desired <= p.upper, d.reason
    if d.desired > max(current, p.lower):
        step = max(p.scale_up_max_step, math.ceil(current * p.scale_up_max_percent / 100))
        assert d.desired - current <= step, d.reason
    assert all(wanted is None or 0 <= wanted <= MOST for wanted in d.per_metric.values())
    assert "\n" not in d.reason
    assert len(d.reason) < 300, d.reason


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", UNUSABLE, ids=str)
def test_an_unusable_total_holds_the_count_and_names_the_value(value: float, mode: str, limits: str) -> None:
    """NaN, infinite or negative totals mean a broken query: never a reason to scale, down or up."""
    eng = _engine(mode, limits)
    current = _panicking(eng) if mode == "panic" else 6
    d = eng.decide(obs(1, current, value))
    _within_policy(eng, current, d)
    assert d.held
    assert d.desired == current
    assert d.panic is (mode == "panic")
    assert d.per_metric == {WAITING: None}
    assert d.reason == f"hold {current}: metrics missing: {WAITING} (unusable value {SHOWN[value]})"


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [*UNUSABLE, None], ids=str)
@pytest.mark.parametrize(("current", "bound"), [(60, "max_replicas"), (1, "min_replicas")])
def test_the_bounds_hold_while_every_metric_is_unusable(
    value: float | None, mode: str, limits: str, current: int, bound: str
) -> None:
    # The DGD's replicas edited by hand past the policy's bounds, then the query breaks.
    eng = _engine(mode, limits, min_replicas=3)
    if mode == "panic":
        _panicking(eng)
    d = eng.decide(obs(1, current, value))
    expected = 50 if bound == "max_replicas" else 3
    assert (d.desired, d.held) == (expected, True), d.reason
    direction = "down" if expected < current else "up"
    assert d.reason.startswith(f"scale {direction} {current} -> {expected} ({bound}): metrics missing: ")


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("mode", MODES)
def test_an_absurdly_large_total_asks_for_the_most_replicas_within_the_policy(mode: str, limits: str) -> None:
    # The policy allows every replica count Kubernetes can hold; vector(1e300) asks for more.
    eng = _engine(mode, limits, max_replicas=MOST)
    d = eng.decide(obs(0, 1, 1e300))
    _within_policy(eng, 1, d)
    assert d.panic is (mode == "panic")
    assert d.per_metric == {WAITING: MOST}
    assert d.recommendation == MOST
    assert d.desired == (2 if limits == "rate-limits" else MOST)
    assert f"{WAITING} 1e+300 (target 10/replica) wants {MOST}" in d.reason
    if limits == "rate-limits":
        assert "at most +1 per 1s from 1" in d.reason
    # The next decision is limited again: one step at a time, never the whole way at once.
    d2 = eng.decide(obs(1, d.desired, 1e300, ready=1, starting=d.desired - 1))
    _within_policy(eng, d.desired, d2)
    assert d2.desired == (3 if limits == "rate-limits" else MOST)


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("target", "values"),
    [
        (1e-10, [1e300]),  # total / target overflows to inf
        (10.0, [1e307, 1.7e308]),  # a rising total: the look-ahead's sums overflow
        (10.0, [1e308, 1.79e308, 1.797e308]),
    ],
    ids=["quotient-overflows", "slope-overflows", "near-float-max"],
)
def test_totals_near_the_float_limit_never_raise(
    target: float, values: list[float], mode: str, limits: str
) -> None:
    eng = _engine(mode, limits, metrics=(MetricTarget(WAITING, target),), max_replicas=40)
    current = 4
    for t, value in enumerate(values):
        d = eng.decide(obs(float(t), current, value, ready=4, starting=current - 4, restore=5.0))
        _within_policy(eng, current, d)
        assert d.per_metric == {WAITING: MOST}
        # Up by max(1, ceil(50%)) per decision with the limits, else to max_replicas at once.
        assert d.desired == (current + math.ceil(current / 2) if limits == "rate-limits" else 40)
        current = d.desired


_totals = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e300, -1e300, 1.7976931348623157e308, 5e-324]),
)


@settings(max_examples=300, deadline=None)
@given(
    totals=st.lists(st.tuples(_totals, _totals), min_size=1, max_size=12),
    mode=st.sampled_from(MODES),
    limits=st.sampled_from(list(LIMITS)),
    bounds=st.sampled_from([(0, 1), (1, 40), (2, MOST)]),
    start=st.integers(0, 60),
    restore=st.sampled_from([None, 5.0]),
)
def test_every_decision_stays_within_the_policy(
    totals: list[tuple[float | None, float | None]],
    mode: str,
    limits: str,
    bounds: tuple[int, int],
    start: int,
    restore: float | None,
) -> None:
    low, high = bounds
    eng = _engine(
        mode,
        limits,
        min_replicas=low,
        max_replicas=high,
        metrics=(MetricTarget(WAITING, 10.0), MetricTarget(KV, 1e-9)),
    )
    current = start
    for t, (waiting, kv) in enumerate(totals):
        ready = current // 2
        o = obs(float(t), current, waiting, ready=ready, starting=current - ready, restore=restore)
        d = eng.decide(dataclasses.replace(o, metrics={**o.metrics, KV: MetricSample(kv)}))
        _within_policy(eng, current, d)
        current = d.desired


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min_replicas": -1}, "min_replicas must be >= 0"),
        ({"max_replicas": 0, "min_replicas": 0}, "max_replicas must be >= 1"),
        ({"min_replicas": 5, "max_replicas": 3}, r"min_replicas \(5\) must be <= max_replicas \(3\)"),
        ({"metrics": ()}, "at least one metric"),
        (
            {"metrics": (MetricTarget("a", 1.0), MetricTarget("a", 2.0))},
            "metric names must be unique: 'a'",
        ),
        ({"tolerance": 1.0}, r"tolerance must be in \[0, 1\)"),
        ({"tolerance": -0.1}, r"tolerance must be in \[0, 1\)"),
        ({"scale_up_window_s": -1.0}, "scale_up_window_s must be >= 0"),
        ({"scale_down_window_s": -1.0}, "scale_down_window_s must be >= 0"),
        ({"panic_window_s": -1.0}, "panic_window_s must be >= 0"),
        ({"scale_down_grace_s": -1.0}, "scale_down_grace_s must be >= 0"),
        ({"stale_after_s": -1.0}, "stale_after_s must be >= 0"),
        ({"scale_up_max_step": 0}, "scale_up_max_step must be >= 1"),
        ({"scale_up_period_s": 0.0}, "scale_up_period_s must be a finite number > 0"),
        ({"scale_up_period_s": math.inf}, "scale_up_period_s must be a finite number > 0"),
        ({"replica_ceiling": 0}, "replica_ceiling must be None or >= 1"),
        ({"scale_up_max_percent": 0.0}, "scale_up_max_percent must be a finite number > 0"),
        ({"scale_up_max_percent": math.inf}, "scale_up_max_percent must be a finite number > 0"),
        ({"scale_down_max_step": -1}, "scale_down_max_step must be >= 0"),
        ({"panic_threshold": 1.0}, "panic_threshold must be > 1"),
        ({"restore_latency_s": -1.0}, "restore_latency_s must be None or >= 0"),
        ({"cold_start_latency_s": -1.0}, "cold_start_latency_s must be None or >= 0"),
    ],
)
def test_param_validation(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params(**kw)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf, math.nan])
def test_metric_target_validation(target: float) -> None:
    with pytest.raises(ValueError, match="target_per_replica must be a finite number > 0"):
        MetricTarget("m", target)


def test_metric_name_required() -> None:
    with pytest.raises(ValueError, match="metric name must not be empty"):
        MetricTarget("", 1.0)


def test_params_defaults() -> None:
    p = PolicyParams(min_replicas=1, max_replicas=4, metrics=[MetricTarget(WAITING, 10.0)])  # type: ignore[arg-type]
    assert p.metrics == (MetricTarget(WAITING, 10.0),)
    assert (p.tolerance, p.scale_up_window_s, p.scale_down_window_s) == (0.1, 0.0, 60.0)
    assert (p.scale_up_max_step, p.scale_up_max_percent, p.scale_up_period_s) == (4, 300.0, 15.0)
    assert (p.scale_down_max_step, p.replica_ceiling) == (1, None)
    assert (p.scale_down_grace_s, p.panic_window_s, p.panic_threshold, p.stale_after_s) == (
        30.0,
        6.0,
        2.0,
        10.0,
    )
    assert (p.restore_latency_s, p.cold_start_latency_s) == (None, None)


def test_observation_validation() -> None:
    with pytest.raises(ValueError, match="ready must be >= 0"):
        Observation(now=0, ready=-1, starting=0, current_desired=0, metrics={})


def test_a_seeded_engine_waits_a_whole_window_before_its_first_scale_down() -> None:
    # A restarted controller (or a new policy) has no history: it must not scale down at once.
    engine = PolicyEngine(
        PolicyParams(
            min_replicas=1,
            max_replicas=10,
            metrics=(MetricTarget("q", 10.0),),
            scale_down_window_s=30.0,
            scale_down_max_step=10,
            scale_down_grace_s=0.0,
        )
    )

    def obs(now: float) -> Observation:
        return Observation(
            now=now,
            ready=6,
            starting=0,
            current_desired=6,
            metrics={"q": MetricSample(5.0)},
            replica_ages_s=(100.0,) * 6,
        )

    engine.seed(1000.0, 6)
    assert engine.decide(obs(1000.0)).desired == 6
    assert engine.decide(obs(1020.0)).desired == 6
    assert engine.decide(obs(1031.0)).desired == 1
