"""Errors about artifacts: every message names the file or field and both values where two differ."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ArtifactError", "ArtifactNotFoundError"]


class ArtifactError(Exception):
    """An artifact is invalid, damaged, incompatible or from a newer format.

    ``problems`` lists every finding; ``str()`` is the single finding or all of them joined.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class ArtifactNotFoundError(ArtifactError):
    """No published artifact under that identity hash."""
