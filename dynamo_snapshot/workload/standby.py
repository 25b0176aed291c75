"""Standby: what a restore pod's main container runs on a kubelet node until the agent restores into it.

The controller sets ``SNAPSHOT_RESTORE_STANDBY=1`` on restore pods. A worker's entrypoint that sees it
calls ``run_standby()`` instead of cold-starting: the process stays the container's first process (the
kubelet's, probes', ``kubectl logs``' view of the container), says in the control dir that it waits, and
the agent restores the checkpointed tree into the container's namespaces and cgroup. Like Dynamo's own
standby it also leaves restore-context.json, this container's values of the environment a restored
Dynamo worker reads again. The restored
worker becomes this process's child; when the restored processes are gone, standby exits with the
worker's status, so the kubelet sees the container end as the worker ended. SIGTERM (the kubelet
stopping the pod) goes on to every process of the container.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from dynamo_snapshot.api.protocol import (
    ENV_RESTORE_STANDBYS,
    FILE_RESTORE_CONTEXT,
    FILE_RESTORE_FAILED,
    FILE_RESTORE_STANDBY,
    RESTORE_CONTEXT_ENV_NAMES,
)
from dynamo_snapshot.fileio import write_atomic
from dynamo_snapshot.fileio.beneath import read_json_beneath
from dynamo_snapshot.workload.handshake import control_dir

__all__ = ["RESTORE_FAILED_EXIT", "run_standby", "standby_requested"]

# How often a standby with no child yet looks again (a restored child wakes os.wait at once).
_IDLE_POLL_S = 0.2
# A standby started after the pod's restore failed: nothing will be restored into it.
RESTORE_FAILED_EXIT = 1
_RESTORE_FAILED_MAX = 64 << 10


def _restore_failed(ctl: Path) -> str | None:
    """What the agent's restore-failed says (its message, else that it is there); None without it. Only a
    regular file with one name counts, read beneath the directory: it is the pod's own, and a fifo put
    there must not hang the start."""
    try:
        doc = read_json_beneath(ctl / FILE_RESTORE_FAILED, _RESTORE_FAILED_MAX)
    except OSError:
        return None
    except ValueError:
        doc = None
    message = doc.get("message") if isinstance(doc, dict) else None
    return str(message) if message else "no reason given"


def standby_requested(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(env.get(name) == "1" for name in ENV_RESTORE_STANDBYS)


def _write(path: Path, content: dict[str, object]) -> None:
    # Whole, not durable: the control directory does not outlive the pod.
    write_atomic(path, json.dumps(content, sort_keys=True).encode(), durable=False)


def _exit_code(status: int) -> int:
    # A worker killed by a signal ends the container the way a shell reports it: 128 + signal.
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _forward(sig: int, _frame: FrameType | None) -> None:
    # kill(-1) from the first process of a PID namespace reaches every other process of it, the
    # restored tree's included, and never this one.
    try:
        os.kill(-1, sig)
    except ProcessLookupError:
        raise SystemExit(128 + sig) from None


def run_standby(directory: Path | None = None) -> int:
    """Wait as the container's placeholder; returns the restored worker's exit code once its processes
    are gone (the caller exits with it)."""
    ctl = directory if directory is not None else control_dir()
    failed = _restore_failed(ctl) if ctl is not None else None
    if failed is not None:
        print(f"standby: this pod's restore failed ({failed}); a new pod restores or cold-starts", flush=True)
        return RESTORE_FAILED_EXIT
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    if ctl is not None:
        ctl.mkdir(parents=True, exist_ok=True)
        # As Dynamo's standby does: this container's values (Kubernetes resolved them) of what a restored
        # Dynamo worker reads again.
        env = {name: os.environ.get(name) for name in sorted(RESTORE_CONTEXT_ENV_NAMES)}
        _write(ctl / FILE_RESTORE_CONTEXT, {"env": env})
        _write(ctl / FILE_RESTORE_STANDBY, {"pid": os.getpid(), "since": time.time()})
    print("standby: waiting for the node agent to restore the checkpoint into this container", flush=True)
    first: int | None = None
    seen = False
    while True:
        try:
            _pid, status = os.wait()
        except ChildProcessError:
            if seen:
                return first if first is not None else 0
            time.sleep(_IDLE_POLL_S)
            continue
        seen = True
        if first is None:
            first = _exit_code(status)
