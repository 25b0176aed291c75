"""Sentinel files the agent writes into a worker's control directory (restore-complete,
snapshot-complete, weights-verified, restore-context.json): JSON, seen whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dynamo_snapshot.fileio import write_atomic

__all__ = ["write_sentinel"]


def write_sentinel(path: Path, doc: dict[str, Any]) -> None:
    # Not durable: the control directory does not outlive its pod, and the worker polls for the name.
    write_atomic(path, json.dumps(doc, sort_keys=True).encode(), durable=False)
