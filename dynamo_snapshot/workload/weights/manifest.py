"""The control directory's weights manifest (FILE_WEIGHTS_MANIFEST, weights.json): which weights files
the worker saved and how much GPU memory it released, for the node agent to carry and put back; and the
worker's side of the agent's weights check (FILE_WEIGHTS_VERIFIED)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from dynamo_snapshot.api.protocol import (
    FILE_WEIGHTS_MANIFEST,
    FILE_WEIGHTS_VERIFIED,
    RESTORE_WEIGHTS_CHECK,
    WEIGHTS_CHECK_PENDING,
)
from dynamo_snapshot.fileio import WarmResult, warm_page_cache, write_atomic

__all__ = [
    "FILE_WEIGHTS_MANIFEST",
    "OffloadManifest",
    "WeightsFile",
    "parse_offload_manifest",
    "read_offload_manifest",
    "read_weights_manifest",
    "wait_for_weights_verified",
    "warm_weights",
    "weights_check_pending",
    "write_weights_manifest",
]

# Version 3 lists no whole-file SHA-256: the header's chunk digests and data digest are the file's check,
# and the artifact's chunk digests seal it once carried. Older versions' `sha256` is read past.
_MANIFEST_VERSION: Final = 3
_MANIFEST_VERSIONS_READ: Final = (1, 2, 3)


@dataclass(frozen=True)
class WeightsFile:
    """One weights file as weights.json lists it."""

    path: str  # absolute, as the worker sees it
    bytes: int  # file size
    data_digest: str  # the header's digest of the data section
    device: int  # CUDA device ordinal of the region


@dataclass(frozen=True)
class OffloadManifest:
    """What FILE_WEIGHTS_MANIFEST says: the weights files, and the GPU memory the worker released before
    the checkpoint and maps again after the restore (bytes per CUDA device ordinal)."""

    files: list[WeightsFile] = field(default_factory=list)
    released_bytes: dict[int, int] = field(default_factory=dict)
    # The worker waits for FILE_WEIGHTS_VERIFIED before it serves, so the agent may let it load the
    # weights while it still checks them (absent in manifests of older SDKs: False).
    waits_for_weights_check: bool = False
    # Its loads wait for each byte of a weights file still arriving (weights.arrival), so the agent may
    # put the files back before they are whole (absent in manifests of older SDKs: False).
    reads_arriving_weights: bool = False


def write_weights_manifest(
    control_dir: Path | str,
    files: Sequence[WeightsFile],
    released_bytes: Mapping[int, int] | None = None,
    *,
    waits_for_weights_check: bool = False,
    reads_arriving_weights: bool = False,
) -> Path:
    """Write FILE_WEIGHTS_MANIFEST into the control directory (atomically); its path."""
    path = Path(control_dir) / FILE_WEIGHTS_MANIFEST
    doc = {
        "version": _MANIFEST_VERSION,
        "files": [asdict(f) for f in files],
        "released_bytes": {str(d): int(n) for d, n in sorted((released_bytes or {}).items())},
        "waits_for_weights_check": waits_for_weights_check,
        "reads_arriving_weights": reads_arriving_weights,
    }
    write_atomic(path, json.dumps(doc, sort_keys=True, indent=1).encode())
    return path


def read_offload_manifest(control_dir: Path | str) -> OffloadManifest | None:
    """FILE_WEIGHTS_MANIFEST of the control directory; None when there is none. ValueError if damaged."""
    path = Path(control_dir) / FILE_WEIGHTS_MANIFEST
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return parse_offload_manifest(doc, str(path))


def parse_offload_manifest(doc: Any, source: str = FILE_WEIGHTS_MANIFEST) -> OffloadManifest:
    """The weights manifest in ``doc`` (JSON as read from ``source``); ValueError naming ``source``."""
    path = source
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or doc.get("version") not in _MANIFEST_VERSIONS_READ:
        raise ValueError(f"{path}: not a version {_MANIFEST_VERSION} weights manifest")
    out = []
    for entry in files:
        try:
            out.append(
                WeightsFile(
                    path=str(entry["path"]),
                    bytes=int(entry["bytes"]),
                    data_digest=str(entry["data_digest"]),
                    device=int(entry["device"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad entry {entry!r}") from None
    released = doc.get("released_bytes", {})
    try:
        released_bytes = {int(d): int(n) for d, n in released.items()}
    except (AttributeError, TypeError, ValueError):
        raise ValueError(f"{path}: bad released_bytes {released!r}") from None
    if any(d < 0 or n < 0 for d, n in released_bytes.items()):
        raise ValueError(f"{path}: negative released_bytes {released!r}")
    flags = []
    for name in ("waits_for_weights_check", "reads_arriving_weights"):
        flag = doc.get(name, False)
        if not isinstance(flag, bool):
            raise ValueError(f"{path}: {name} must be true or false, not {flag!r}")
        flags.append(flag)
    waits, reads_arriving = flags
    return OffloadManifest(out, released_bytes, waits, reads_arriving)


def weights_check_pending(content: Any) -> bool:
    """Whether restore-complete's content says the agent is still checking the weights."""
    return isinstance(content, Mapping) and content.get(RESTORE_WEIGHTS_CHECK) == WEIGHTS_CHECK_PENDING


def wait_for_weights_verified(
    control_dir: Path | str, *, timeout: float | None = None, poll: float = 0.005
) -> float:
    """Block until the agent wrote FILE_WEIGHTS_VERIFIED; the seconds waited. No timeout by default:
    the agent stops this worker when the check fails (or when it restarts during the restore), and a
    check of a big file on slow storage may take long; with ``timeout``, TimeoutError after that many
    seconds, never serving weights nobody checked."""
    path = Path(control_dir) / FILE_WEIGHTS_VERIFIED
    started = time.monotonic()
    while not path.exists():
        waited = time.monotonic() - started
        if timeout is not None and waited > timeout:
            raise TimeoutError(f"the node agent did not confirm the weights within {timeout:.0f}s ({path})")
        time.sleep(poll)
    return time.monotonic() - started


def read_weights_manifest(control_dir: Path | str) -> list[WeightsFile]:
    """The weights files FILE_WEIGHTS_MANIFEST lists; [] when there is none. ValueError if damaged."""
    manifest = read_offload_manifest(control_dir)
    return manifest.files if manifest is not None else []


def warm_weights(control_dir: Path | str, *, threads: int = 8) -> list[WarmResult]:
    """warm_page_cache for every file the control directory's weights.json lists (missing files are
    skipped: the restore will fail on them with a clearer error)."""
    return [
        warm_page_cache(f.path, threads=threads)
        for f in read_weights_manifest(control_dir)
        if os.path.exists(f.path)
    ]
