"""restore-complete's content: the restore-pod contract's "key=value" lines (the restored process's pid as its
PID namespace numbers it, and this project's JSON document under its own key), or that document alone for
a worker whose SDK reads nothing else. Which one a worker gets is decided at checkpoint, from its ready
file, and kept in the artifact's manifest: a restore writes what the checkpointed process can read."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.agent.sentinels import read_worker_json
from dynamo_snapshot.api import protocol

__all__ = ["JSON", "LINES", "MANIFEST_KEY", "content", "format_for_worker"]

MANIFEST_KEY: Final = "restoreComplete"
LINES: Final = "lines"
JSON: Final = "json"
# Far above any ready file this SDK writes: one too long to read counts as not this SDK's, and an SDK that
# reads only JSON must not be taken for that.
_READY_MAX = 1 << 20


def format_for_worker(control_dir: Path) -> str:
    """The format the worker whose ready file is in ``control_dir`` reads: the JSON document alone only
    for this SDK's ready file (a JSON object with its "protocol") that does not list
    FEATURE_RESTORE_COMPLETE_LINES; the contract's lines for everyone else (Dynamo's own worker checks that
    the file exists)."""
    for name in protocol.FILES_READY:
        with contextlib.suppress(OSError, ValueError):
            doc = read_worker_json(control_dir / name, _READY_MAX)
            if not isinstance(doc, dict) or "protocol" not in doc:
                return LINES
            features = doc.get(protocol.READY_FEATURES)
            listed = isinstance(features, list) and protocol.FEATURE_RESTORE_COMPLETE_LINES in features
            return LINES if listed else JSON
    return LINES


def content(doc: Mapping[str, Any], pid: int | None, fmt: str) -> bytes:
    """restore-complete's bytes in format ``fmt`` (the manifest's; JSON where it recorded none): ``doc``
    alone as JSON, or the lines, ``pid`` first where known."""
    document = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if fmt != LINES:
        return document.encode()
    lines = [f"{protocol.RESTORE_COMPLETE_PID_KEY}={pid}"] if pid is not None and pid > 0 else []
    lines.append(f"{protocol.RESTORE_COMPLETE_DOC_KEY}={document}")
    return ("\n".join(lines) + "\n").encode()
