"""CRIU's version, parsed from ``criu --version``."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CriuVersion"]

_VERSION = re.compile(r"^\s*Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)


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
