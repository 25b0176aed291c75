"""The scale-up rate limit: how many replicas a service may have after a scale-up.

The HPA's scale-up rule (two policies, ``Pods`` and ``Percent`` per period, the larger one applying; its
defaults are 4 pods and 100 % per 15 s): within any ``period_s`` the replicas may grow from the count
at the period's start ``B`` to at most ``B + max(max_step, ceil(B * max_percent / 100))``.

``B`` is the *fewest* replicas the service was seen with over the last ``period_s`` (the observations
are the service's replica counts as the autoscaler read them, not the decisions it wrote). Reading the
observed counts rather than counting its own scale-ups keeps the limit right when a write failed or
the autoscaler's cache lags its own write (the same count seen again asks for the same limit), and
a scale-down inside the period can only lower ``B``, never widen the limit. Every mode obeys it, panic
included: Knative's KPA caps panic scale-up too (its max-scale-up-rate), so that one absurd metric
cannot order thousands of replicas in one decision.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Allowance", "ScaleUpLimit"]

# Guards ceil() against float noise such as 30.000000000000004 / 10.
_EPS = 1e-9


@dataclass(frozen=True)
class Allowance:
    """What the limit allows now: at most ``most`` replicas, ``step`` more than the period's ``base``."""

    base: int
    step: int
    period_s: float

    @property
    def most(self) -> int:
        return self.base + self.step

    def text(self) -> str:
        """For a decision's reason, e.g. ``at most +4 per 15s from 1``."""
        return f"at most +{self.step} per {self.period_s:g}s from {self.base}"


class ScaleUpLimit:
    """The observed replica counts of the last period, and the allowance they give."""

    def __init__(self, max_step: int, max_percent: float, period_s: float) -> None:
        if max_step < 1:
            raise ValueError(f"scale_up_max_step must be >= 1, got {max_step}")
        if not (math.isfinite(max_percent) and max_percent > 0):
            raise ValueError(f"scale_up_max_percent must be a finite number > 0, got {max_percent}")
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"scale_up_period_s must be a finite number > 0, got {period_s}")
        self.max_step = max_step
        self.max_percent = max_percent
        self.period_s = period_s
        self._seen: deque[tuple[float, int]] = deque()

    def observe(self, now: float, replicas: int) -> None:
        """Record the service's replica count at ``now`` (observations come in time order)."""
        self._seen.append((now, replicas))
        while now - self._seen[0][0] >= self.period_s:
            self._seen.popleft()

    def allowance(self) -> Allowance:
        """The allowance of the period ending at the last observation (one must have been made)."""
        base = min(replicas for _, replicas in self._seen)
        step = max(self.max_step, math.ceil(base * self.max_percent / 100.0 - _EPS))
        return Allowance(base, step, self.period_s)
