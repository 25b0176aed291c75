"""Linux I/O priority of the calling thread (``ioprio_set(2)``), so that a bulk check of an artifact can
yield the disk to the small synchronous reads of the programs a restore starts (CRIU's start-up, the
resumed worker's page faults). Honoured by the mq-deadline and bfq schedulers; "none" ignores it.
Elsewhere (not Linux, unknown architecture, refused) the calls report False and change nothing."""

from __future__ import annotations

import ctypes
import platform
import sys
import threading

__all__ = ["BEST_EFFORT_DEFAULT", "IDLE", "get_thread_ioprio", "set_thread_ioprio"]

_CLASS_SHIFT = 13
_WHO_PROCESS = 1  # with a thread id: that one thread
# (class << 13) | level
IDLE = 3 << _CLASS_SHIFT
BEST_EFFORT_DEFAULT = (2 << _CLASS_SHIFT) | 4

# (ioprio_set, ioprio_get) by machine.
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}


def _syscall(which: int, *args: int) -> int:
    nums = _SYSCALLS.get(platform.machine())
    if nums is None or sys.platform != "linux":
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(nums[which], *(ctypes.c_long(a) for a in args)))


def set_thread_ioprio(value: int) -> bool:
    """Give the calling thread I/O priority ``value``; False where the kernel cannot or will not."""
    return _syscall(0, _WHO_PROCESS, threading.get_native_id(), value) == 0


def get_thread_ioprio() -> int | None:
    """The calling thread's I/O priority, None where it cannot be read."""
    got = _syscall(1, _WHO_PROCESS, threading.get_native_id())
    return got if got >= 0 else None
