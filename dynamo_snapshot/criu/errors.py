"""The one error CRIU operations raise, carrying the log lines that explain it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CriuError", "known_cause", "log_excerpt", "summary_line"]

# CRIU marks problems inconsistently ("Error (...)", "Warn ... Failed to", "Can't ..."), so match words.
_PROBLEM = re.compile(r"error|can't|cannot|fail|unable", re.IGNORECASE)
# "(00.025762) Error (criu/cr-dump.c:2111): Dumping FAILED." only says that something failed earlier.
_GENERIC = re.compile(r"\b(Dumping|Restoring|Pre-dumping) FAILED\.?\s*$")
_TIMESTAMP = re.compile(r"^\(\d+\.\d+\)\s*")

PROBLEM_LINES = 10
TAIL_LINES = 3


def log_excerpt(text: str, *, problems: int = PROBLEM_LINES, tail: int = TAIL_LINES) -> tuple[str, ...]:
    """The last ``problems`` lines that look like errors, then the last ``tail`` lines, in log order."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    picked = {i for i, line in enumerate(lines) if _PROBLEM.search(line)}
    keep = sorted(picked)[-problems:] if problems > 0 else []
    keep_set = set(keep) | set(range(max(0, len(lines) - tail), len(lines)))
    return tuple(lines[i] for i in sorted(keep_set))


def summary_line(excerpt: Sequence[str]) -> str | None:
    """The most telling line: the last explicit error that is not CRIU's generic closing line."""
    errors = [line for line in excerpt if "Error" in line and not _GENERIC.search(line)]
    candidates = errors or [line for line in excerpt if _PROBLEM.search(line) and not _GENERIC.search(line)]
    if not candidates:
        return None
    line = _TIMESTAMP.sub("", candidates[-1])
    # "Error (criu/seize.c:63): msg" -> "msg": the source location helps in the excerpt, not the summary.
    return re.sub(r"^(Error|Warn)\s*\([^)]*\):\s*", "", line)


# Failures whose log line does not say what to do about them.
_KNOWN_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"Can't get 1:(16|34) opt: Operation not supported"),
        "this CRIU cannot dump a TCP or UDP socket on Linux 6.16 or later (it reads SO_PASSCRED and "
        "SO_PASSSEC, which those kernels refuse on such sockets): use CRIU 4.2 or later, or 4.1.1 with "
        "scripts/criu-so-passcred.patch as this project builds it, or have the worker close its TCP "
        "and UDP sockets before it signals ready-for-snapshot",
    ),
    (
        re.compile(r"Connected TCP socket, consider using --tcp-established"),
        "the worker holds an established TCP connection (a NCCL communicator, a client of another "
        "service), which cannot be restored where its peer is gone: the worker closes it before it "
        "signals ready-for-snapshot (docs/workload-contract.md, multi-GPU workers)",
    ),
)


def known_cause(text: str) -> str | None:
    """What a CRIU log's failure means and what to do, where the log's own line does not say."""
    for pattern, cause in _KNOWN_CAUSES:
        if pattern.search(text):
            return cause
    return None


class CriuError(RuntimeError):
    """A CRIU operation failed; ``str()`` quotes CRIU's own explanation, never just an exit code.

    ``op`` is the CRIU command ("dump", "restore", "check", "version") or "find" when the binary is
    missing; ``returncode`` is None when CRIU never ran.
    """

    def __init__(
        self,
        op: str,
        returncode: int | None,
        message: str,
        log_excerpt: Sequence[str] = (),
        *,
        log_path: Path | None = None,
    ) -> None:
        self.op = op
        self.returncode = returncode
        self.message = message
        self.log_excerpt = tuple(log_excerpt)
        self.log_path = log_path
        super().__init__(self._render())

    def _render(self) -> str:
        if self.returncode is None and not self.log_excerpt:
            return self.message
        head = f"criu {self.op} failed"
        if self.returncode is not None:
            head += f" (exit {self.returncode})"
        lines = [f"{head}: {self.message}"]
        if self.log_excerpt:
            lines.append(f"  from the log {self.log_path}:" if self.log_path else "  from CRIU's output:")
            lines += [f"    {line}" for line in self.log_excerpt]
        return "\n".join(lines)
