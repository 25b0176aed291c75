"""restore-complete's content: the restore-pod contract's "key=value" lines (the restored process's pid as its
PID namespace numbers it, and this project's JSON document under its own key), or that document alone for
a worker whose SDK reads nothing else. Which one a worker gets is decided at checkpoint, from its ready
file, and kept in the artifact's manifest: a restore writes what the checkpointed process can read."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.agent.runtime.base import namespace_pid
from dynamo_snapshot.agent.sentinels import ready_json, ready_lists, write_sentinel_bytes
from dynamo_snapshot.api import protocol

__all__ = ["JSON", "LINES", "MANIFEST_KEY", "content", "format_for_worker", "write"]

MANIFEST_KEY: Final = "restoreComplete"
LINES: Final = "lines"
JSON: Final = "json"


def format_for_worker(control_dir: Path) -> str:
    """The format the worker whose ready file is in ``control_dir`` reads: the JSON document alone only
    for this SDK's ready file (a JSON object with its "protocol") that does not list
    FEATURE_RESTORE_COMPLETE_LINES; the contract's lines for everyone else (Dynamo's own worker writes the
    text "ready" and checks only that restore-complete exists)."""
    doc = ready_json(control_dir)
    if not isinstance(doc, dict) or "protocol" not in doc:
        return LINES
    return LINES if ready_lists(doc, protocol.FEATURE_RESTORE_COMPLETE_LINES) else JSON


def content(doc: Mapping[str, Any], pid: int | None, fmt: str) -> bytes:
    """restore-complete's bytes in format ``fmt`` (the manifest's; JSON where it recorded none): ``doc``
    alone as JSON, or the lines, ``pid`` first where known."""
    document = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if fmt != LINES:
        return document.encode()
    lines = [f"{protocol.RESTORE_COMPLETE_PID_KEY}={pid}"] if pid is not None and pid > 0 else []
    lines.append(f"{protocol.RESTORE_COMPLETE_DOC_KEY}={document}")
    return ("\n".join(lines) + "\n").encode()


def write(control_dir: Path, doc: Mapping[str, Any], pid: int, fmt: str) -> None:
    """restore-complete for the restored process ``pid`` (a host pid; the lines name it as its own PID
    namespace does). Blocking: call it in a thread."""
    data = content(doc, namespace_pid(pid), fmt)
    write_sentinel_bytes(control_dir / protocol.FILE_RESTORE_COMPLETE, data)
