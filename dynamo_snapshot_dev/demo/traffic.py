"""Load for the demo's workers and a timeline of what happened: requests offered and in flight, replicas
asked for and serving."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dynamo_snapshot_dev.demo.stack import Endpoint


@dataclass
class Sample:
    t: float
    offered_rps: float
    in_flight: int
    desired: int
    serving: int


class Load:
    """Sends POST /generate at `rps` per second, round-robin over the serving workers, from a thread."""

    def __init__(self, endpoints: Callable[[], list[Endpoint]]) -> None:
        self._endpoints = endpoints
        self.rps = 0.0
        self.in_flight = 0
        self.sent = self.ok = self.failed = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="load")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        counter = itertools.count()
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.rps <= 0:
                time.sleep(0.05)
                next_at = time.monotonic()
                continue
            targets = self._endpoints()
            if targets:
                target = targets[next(counter) % len(targets)]
                with self._lock:
                    self.in_flight += 1
                    self.sent += 1
                self._pool.submit(self._one, target)
            next_at += 1.0 / self.rps
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self, target: Endpoint) -> None:
        ok = False
        try:
            req = urllib.request.Request(f"http://{target.address}/generate", data=b"hello", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        with self._lock:
            self.in_flight -= 1
            if ok:
                self.ok += 1
            else:
                self.failed += 1


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.start

    def mark(self, what: str) -> None:
        self.marks.append((self.now(), what))
