"""Child processes of the local cluster: started with their output in a log file, ended with their parent,
stopped politely and then firmly. One place for the control plane, the real node and Prometheus."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: a killed test run or demo must not leave a component behind holding ports and data."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    log_handle: IO[bytes]
    argv: list[str]


def spawn_logged(
    logs: Path, name: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Proc:
    """Start `argv` with stdout and stderr appended to `logs/<name>.log`."""
    log = logs / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("ab")
    popen = subprocess.Popen(
        argv,
        stdout=handle,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
        preexec_fn=die_with_parent,
    )
    return Proc(name, popen, log, handle, argv)


def terminate(popen: subprocess.Popen[bytes], timeout: float, kill_timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
    popen.terminate()
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=kill_timeout)


def log_tail(path: Path, lines: int = 20, *, sep: str = "\n") -> str:
    """The last ``lines`` lines of a component's log, for an error that says why it did not start."""
    try:
        return sep.join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Started:
    """A component used as ``with Component() as c:``: started on entry, stopped on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
