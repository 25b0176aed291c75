"""A restored worker's host and domain name, set in its UTS namespace.

CRIU writes the checkpointed names into the UTS namespace it joins, the restore pod's, which must keep its
own: the worker's /etc/hosts names only its own pod, and a lookup of the old name waits on DNS.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError

__all__ = ["set_uts_names", "uts_names"]

_CLONE_NEWUTS = 0x04000000  # linux/sched.h


def uts_names(pid: int) -> tuple[str, str]:
    """The host and domain name of ``pid``'s UTS namespace."""
    names: list[str] = []

    def read() -> None:
        # /proc/sys/kernel shows the names of the reader's UTS namespace.
        for name in ("hostname", "domainname"):
            names.append(Path(f"/proc/sys/kernel/{name}").read_text().rstrip("\n"))

    _in_namespace(pid, read)
    return names[0], names[1]


def set_uts_names(pid: int, host: str, domain: str) -> None:
    """sethostname(2) and setdomainname(2) in ``pid``'s UTS namespace (/proc/sys, where they could be
    written, is read-only in an unprivileged container)."""
    libc = ctypes.CDLL(None, use_errno=True)
    host_b, domain_b = host.encode(), domain.encode()

    def write() -> None:
        for name, call, args in (
            ("sethostname", libc.sethostname, (host_b, len(host_b))),
            ("setdomainname", libc.setdomainname, (domain_b, len(domain_b))),
        ):
            if call(*args) != 0:
                raise OSError(ctypes.get_errno(), f"{name}: {os.strerror(ctypes.get_errno())}")

    _in_namespace(pid, write)


def _in_namespace(pid: int, work: Callable[[], None]) -> None:
    """``work`` in a thread of its own that joins ``pid``'s UTS namespace (a UTS namespace is per thread)
    and ends with it; WorkloadRuntimeError for what failed."""
    errors: list[str] = []

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWUTS) != 0:
                    raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            work()
        except OSError as e:
            errors.append(str(e))

    thread = threading.Thread(target=run, name=f"uts-{pid}")
    thread.start()
    thread.join()
    if errors:
        raise WorkloadRuntimeError(f"the restore container's host name (pid {pid}): {errors[0]}")
