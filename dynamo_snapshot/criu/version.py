"""CRIU's version, parsed from ``criu --version``."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CriuVersion", "socket_dump_caveat"]

_VERSION = re.compile(r"^\s*Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
_KERNEL = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True, order=True)
class CriuVersion:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> CriuVersion:
        """Read the "Version: 4.1.1" line of ``criu --version`` (a GitID line may follow)."""
        match = _VERSION.search(text)
        if match is None:
            first = text.strip().splitlines()[0] if text.strip() else "no output"
            raise ValueError(f"cannot read a CRIU version from {first!r}")
        major, minor, patch = match.groups()
        return cls(int(major), int(minor), int(patch or 0))

    def at_least(self, minimum: tuple[int, ...]) -> bool:
        return (self.major, self.minor, self.patch) >= tuple(minimum) + (0,) * (3 - len(minimum))

    def __str__(self) -> str:
        # CRIU names its x.y.0 releases "x.y" (e.g. 3.17, 4.0), so print them the same way.
        return f"{self.major}.{self.minor}" + (f".{self.patch}" if self.patch else "")


def socket_dump_caveat(version: CriuVersion, kernel_release: str) -> str | None:
    """What this CRIU cannot do on this kernel, for the agent to say at start, or None.

    Linux 6.16 refuses SO_PASSCRED and SO_PASSSEC on TCP and UDP sockets, and CRIU before 4.2 reads
    them for every such socket it dumps, so any worker holding one fails its checkpoint
    (checkpoint-restore/criu#2711; seen on the H200's 6.18 kernel with CRIU 4.1.1)."""
    match = _KERNEL.match(kernel_release)
    if match is None or (int(match[1]), int(match[2])) < (6, 16) or version.at_least((4, 2)):
        return None
    return (
        f"CRIU {version} cannot checkpoint a worker holding a TCP or UDP socket on Linux {kernel_release} "
        "(fixed in CRIU 4.2): workers must close theirs before ready-for-snapshot"
    )
