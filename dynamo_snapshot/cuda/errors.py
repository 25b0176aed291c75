"""Errors of the CUDA layer: one type per thing a caller can act on differently, all CudaError."""

from __future__ import annotations

from typing import Any

__all__ = [
    "INSTALL_HINT",
    "CudaError",
    "CudaUnavailableError",
    "DriverTooOldError",
    "NotCudaProcessError",
    "WrongStateError",
]

INSTALL_HINT = "pip install 'dynamo-snapshot[gpu]'"


class CudaError(RuntimeError):
    """A driver call failed: `op` the call, `pid` its target, `result` the CUresult's name.

    Base of every error this package raises, so `except CudaError` catches them all.
    """

    def __init__(self, op: str, pid: int | None, result: str, detail: str = "") -> None:
        self.op = op
        self.pid = pid
        self.result = result
        self.detail = detail
        target = f"(pid {pid})" if pid is not None else ""
        super().__init__(f"{op}{target} failed: {result}" + (f": {detail}" if detail else ""))


class _SetupError(CudaError):
    # Not about one call or one process: the message says it all.
    def __init__(self, message: str) -> None:
        self.op = ""
        self.pid = None
        self.result = ""
        self.detail = message
        RuntimeError.__init__(self, message)


class CudaUnavailableError(_SetupError):
    """cuda-python (or nvidia-ml-py) is not importable, or there is no usable NVIDIA driver."""


class DriverTooOldError(_SetupError):
    """The driver or cuda-python predates the process checkpoint API."""


class NotCudaProcessError(CudaError):
    """The target pid holds no CUDA context (or does not exist): there is nothing to checkpoint."""


class WrongStateError(CudaError):
    """The target's CUDA checkpoint state does not allow the operation (e.g. checkpoint before lock).

    `state` is the state it is in (a ProcessState value, or "unknown"), `expected` the one `op` needs.
    """

    def __init__(self, op: str, pid: int, state: str, expected: str, result: str = "") -> None:
        self.state = state
        self.expected = expected
        super().__init__(
            op, pid, result or "wrong state", f"the process is {state}; {op} needs it {expected}"
        )


def describe_result(driver: Any, result: Any) -> str:
    """The driver's own text for a CUresult (cuGetErrorString), or "" when it has none."""
    fn = getattr(driver, "cuGetErrorString", None)
    if fn is None:
        return ""
    try:
        out = fn(result)
    except Exception:
        return ""
    text = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if isinstance(text, bytes):
        return text.decode(errors="replace")
    return text if isinstance(text, str) else ""
