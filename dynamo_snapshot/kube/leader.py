"""Leader election on a coordination.k8s.io/v1 Lease (client-go's leaderelection, Lease lock only).

Safety comes from the apiserver, not from clocks: every acquire and renew is a PUT conditional on the
resourceVersion we read, so two candidates can never both believe they wrote the lease.  Expiry of
someone else's lease is judged by when *we* last saw it change (local monotonic time), never by the
renewTime it carries, so clock skew between machines cannot shorten another leader's term.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from prometheus_client import Gauge

from dynamo_snapshot.kube.kube import (
    LEASE,
    ApiError,
    Kube,
    Obj,
    is_already_exists,
    is_conflict,
    is_not_found,
)

log = logging.getLogger(__name__)

IS_LEADER = Gauge("dynsnap_leader_is_leader", "1 while this process holds the lease", ["lease"])


def _micro_time() -> str:
    # metav1.MicroTime: RFC 3339 with exactly six fractional digits.
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class LeaderElector:
    """Hold the Lease ``namespace/name`` while leading.

    Either ``async with LeaderElector(...) as le:`` (the body runs as leader; watch ``le.lost``), or
    ``await le.run(on_started_leading, on_stopped_leading)``.  Requires
    ``lease_duration > renew_deadline > retry_period``, as client-go does.
    """

    def __init__(
        self,
        kube: Kube,
        *,
        name: str,
        namespace: str,
        identity: str | None = None,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.kube = kube
        self.name = name
        self.namespace = namespace
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.lost = asyncio.Event()
        self._leading = False
        self._observed_rv: str | None = None
        self._observed_at = 0.0
        self._observed_holder = ""
        self._renewer: asyncio.Task[None] | None = None
        self._log = {"lease": f"{namespace}/{name}", "identity": self.identity}

    @property
    def is_leader(self) -> bool:
        return self._leading

    @property
    def observed_holder(self) -> str:
        """The holder in the lease as last read ("" when released or not yet read)."""
        return self._observed_holder

    # ------------------------------------------------------------------ one attempt
    async def try_acquire_or_renew(self) -> bool:
        """One conditional write of the lease in our name; False if someone else validly holds it."""
        now = _micro_time()
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": 0,
        }
        try:
            lease = await self.kube.get(LEASE, self.name, self.namespace)
        except ApiError as e:
            if not is_not_found(e):
                raise
            try:
                created = await self.kube.create(
                    LEASE, {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
                )
            except ApiError as e2:
                if is_already_exists(e2):
                    return False
                raise
            self._observe(created)
            return True

        self._observe(lease)
        old: dict[str, Any] = lease.get("spec") or {}
        holder = old.get("holderIdentity") or ""
        if holder and holder != self.identity:
            duration = float(old.get("leaseDurationSeconds") or self.lease_duration)
            if time.monotonic() < self._observed_at + duration:
                return False
            log.info("taking over an expired lease", extra={**self._log, "previous": holder})
        if holder == self.identity:
            spec["acquireTime"] = old.get("acquireTime") or now
            spec["leaseTransitions"] = old.get("leaseTransitions") or 0
        else:
            spec["leaseTransitions"] = (old.get("leaseTransitions") or 0) + 1
        lease["spec"] = spec
        try:
            updated = await self.kube.replace(LEASE, lease)
        except ApiError as e:
            if is_conflict(e):
                return False  # someone wrote it since we read it: they win this round
            raise
        self._observe(updated)
        return True

    def _observe(self, lease: Obj) -> None:
        rv = lease["metadata"]["resourceVersion"]
        if rv != self._observed_rv:
            self._observed_rv = rv
            self._observed_at = time.monotonic()
        self._observed_holder = (lease.get("spec") or {}).get("holderIdentity") or ""

    # ------------------------------------------------------------------ acquire / renew / release
    async def acquire(self) -> None:
        """Block until we hold the lease."""
        log.info("waiting for leadership", extra=self._log)
        while True:
            try:
                if await self.try_acquire_or_renew():
                    break
            except Exception as e:
                log.warning("lease acquire attempt failed", extra={**self._log, "error": repr(e)})
            await asyncio.sleep(self.retry_period * random.uniform(1.0, 1.2))
        self._set_leading(True)
        self.lost.clear()
        log.info("became leader", extra=self._log)

    async def _renew_loop(self) -> None:
        last_renew = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_period)
            remaining = last_renew + self.renew_deadline - time.monotonic()
            ok = False
            try:
                async with asyncio.timeout(max(remaining, 0.05)):
                    ok = await self.try_acquire_or_renew()
            except Exception as e:
                log.warning("lease renew attempt failed", extra={**self._log, "error": repr(e)})
            if ok:
                last_renew = time.monotonic()
                continue
            stolen = self._observed_holder not in ("", self.identity)
            if stolen or time.monotonic() - last_renew >= self.renew_deadline:
                log.error(
                    "lost leadership",
                    extra={**self._log, "holder": self._observed_holder, "stolen": stolen},
                )
                self._set_leading(False)
                self.lost.set()
                return

    async def release(self) -> None:
        """Give the lease up so a successor takes over at once instead of after lease_duration.

        Never raises: on failure the lease simply expires.
        """
        if not self._leading:
            return
        self._set_leading(False)
        try:
            lease = await self.kube.get(LEASE, self.name, self.namespace)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            now = _micro_time()
            lease["spec"] = {
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": spec.get("leaseTransitions") or 0,
            }
            await self.kube.replace(LEASE, lease)
            log.info("released leadership", extra=self._log)
        except Exception as e:
            log.warning("lease release failed; it will expire", extra={**self._log, "error": repr(e)})

    def _set_leading(self, leading: bool) -> None:
        self._leading = leading
        IS_LEADER.labels(f"{self.namespace}/{self.name}").set(1 if leading else 0)

    # ------------------------------------------------------------------ front doors
    async def __aenter__(self) -> LeaderElector:
        await self.acquire()
        self._renewer = asyncio.create_task(self._renew_loop(), name=f"lease-renew-{self.name}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None
        # Shielded: a cancelled caller (SIGTERM) is exactly the case where the handover must happen.
        await asyncio.shield(self.release())

    async def run(
        self,
        on_started_leading: Callable[[], Coroutine[Any, Any, None]],
        on_stopped_leading: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        """Acquire, run ``on_started_leading`` while we lead, then step down.

        Returns when ``on_started_leading`` returns (lease released) or leadership is lost (``lost`` set;
        ``on_started_leading`` is cancelled, the process should exit).  Cancelling ``run`` cancels
        ``on_started_leading``, waits for it to unwind (its in-flight writes), then releases the lease.
        """
        async with self:
            work = asyncio.create_task(on_started_leading(), name=f"leading-{self.name}")
            lost = asyncio.create_task(self.lost.wait())
            try:
                await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                if not work.done():
                    work.cancel()
                # Wait for the leader's work to unwind before the lease can pass to a successor.
                results = await asyncio.shield(asyncio.gather(work, return_exceptions=True))
                if on_stopped_leading is not None:
                    await on_stopped_leading()
            if isinstance(results[0], Exception):
                raise results[0]
