"""A restored worker's host and domain name, set in its UTS namespace.

CRIU writes the checkpointed names into the UTS namespace it joins, the restore pod's, which must keep its
own: the worker's /etc/hosts names only its own pod, and a lookup of the old name waits on DNS.
"""

from __future__ import annotations

import ctypes
import os
import threading

from dynamo_snapshot.agent.runtime.base import WorkloadRuntimeError

__all__ = ["set_uts_names"]

_CLONE_NEWUTS = 0x04000000  # linux/sched.h


def set_uts_names(pid: int, host: str, domain: str) -> None:
    """sethostname(2) and setdomainname(2) in ``pid``'s UTS namespace. /proc/sys, where nsenter would
    write them, is read-only in an unprivileged container; a thread of its own joins the namespace (a
    UTS namespace is per thread) and ends with it."""
    errors: list[str] = []

    def in_namespace() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(f"/proc/{pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            errors.append(str(e))
            return
        try:
            host_b, domain_b = host.encode(), domain.encode()
            for name, call, args in (
                ("setns", libc.setns, (fd, _CLONE_NEWUTS)),
                ("sethostname", libc.sethostname, (host_b, len(host_b))),
                ("setdomainname", libc.setdomainname, (domain_b, len(domain_b))),
            ):
                if call(*args) != 0:
                    errors.append(f"{name}: {os.strerror(ctypes.get_errno())}")
                    return
        finally:
            os.close(fd)

    thread = threading.Thread(target=in_namespace, name=f"uts-names-{pid}")
    thread.start()
    thread.join()
    if errors:
        raise WorkloadRuntimeError(f"the restore container's host name ({host}): {errors[0]}")
