"""Seconds per phase of one checkpoint or restore, as the pod's annotations and the metrics report them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from dynamo_snapshot.agent.metrics import PHASE_SECONDS

__all__ = ["AWAIT_CONTAINER_PHASE", "Timings"]


# A restore pod's wait for the kubelet to run its container in standby, before the executor's phases.
AWAIT_CONTAINER_PHASE = "await_container"


@dataclass
class Timings:
    phases: dict[str, float] = field(default_factory=dict)
    # Work done beside the phases (not part of their sum), e.g. weights verified during CRIU restore.
    overlapped: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, op: str, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started
            self.phases[name] = round(self.phases.get(name, 0.0) + took, 4)
            PHASE_SECONDS.labels(op, name).observe(took)

    def total(self) -> float:
        return round(sum(self.phases.values()), 4)
