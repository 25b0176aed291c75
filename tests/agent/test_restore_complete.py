"""restore-complete as each worker reads it: the restore-pod contract's lines (pid, then this agent's JSON
document) for this SDK and for Dynamo's worker, the JSON document alone for an SDK that reads only that;
decided from the worker's ready file at checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dynamo_snapshot.agent import restore_complete
from dynamo_snapshot.agent.runtime.base import namespace_pid
from dynamo_snapshot.api import protocol
from dynamo_snapshot.workload import SnapshotHandshake
from dynamo_snapshot.workload import handshake as hs

LINES_FEATURE = protocol.FEATURE_RESTORE_COMPLETE_LINES
READY = protocol.FILE_READY_FOR_SNAPSHOT
DOC = {"podName": "restored-1", "hostname": "restored-1", "env": {"POD_NAME": "restored-1"}, "x": "a=b"}


def _contract_pid(data: bytes) -> int:
    """The restore-pod contract's reading (api/podcontract ParseRestoreComplete, ai-dynamo/snapshot 0e66e97):
    every non-empty line is key=value split at its first '='; the one pid key is a positive integer;
    other keys are ignored."""
    pid = 0
    for line in data.decode().splitlines():
        line = line.strip()
        if not line:
            continue
        key, eq, value = line.partition("=")
        assert eq, f"not key=value: {line!r}"
        if key == protocol.RESTORE_COMPLETE_PID_KEY:
            assert pid == 0, "duplicate pid"
            pid = int(value)
            assert pid > 0
    assert pid, "no pid"
    return pid


def test_lines_satisfy_the_contract_and_carry_the_document() -> None:
    data = restore_complete.content(DOC, 42, restore_complete.LINES)
    assert _contract_pid(data) == 42
    assert data.endswith(b"\n")
    assert hs._parse(data.decode()) == ({**DOC, "pid": 42}, True)


def test_json_is_the_document_alone_for_an_sdk_that_reads_only_that() -> None:
    data = restore_complete.content(DOC, 42, restore_complete.JSON)
    assert json.loads(data) == DOC


def test_an_unknown_pid_leaves_the_pid_line_out() -> None:
    data = restore_complete.content(DOC, None, restore_complete.LINES)
    assert not data.startswith(b"pid=")
    assert hs._parse(data.decode()) == (DOC, True)


def _ready(ctl: Path, name: str, body: str) -> Path:
    ctl.mkdir(exist_ok=True)
    (ctl / name).write_text(body)
    return ctl


@pytest.mark.parametrize(
    ("name", "body", "expected"),
    [
        # This SDK, which lists the feature.
        (READY, json.dumps({"protocol": "2", "features": [LINES_FEATURE]}), "lines"),
        # An older SDK: its JSON ready file without the feature reads JSON only.
        (READY, json.dumps({"protocol": "2", "pid": 1}), "json"),
        (protocol.FILE_READY_FOR_CHECKPOINT, json.dumps({"protocol": "1", "features": []}), "json"),
        # Dynamo's worker writes the text "ready" and checks only that restore-complete exists.
        (READY, "ready", "lines"),
        # JSON that is not this SDK's.
        (READY, json.dumps({"ready": True}), "lines"),
    ],
)  # fmt: skip
def test_the_format_follows_the_workers_ready_file(
    tmp_path: Path, name: str, body: str, expected: str
) -> None:
    assert restore_complete.format_for_worker(_ready(tmp_path / "ctl", name, body)) == expected


def test_no_ready_file_gets_the_contracts_lines(tmp_path: Path) -> None:
    (tmp_path / "ctl").mkdir()
    assert restore_complete.format_for_worker(tmp_path / "ctl") == restore_complete.LINES


def test_a_ready_file_planted_as_a_link_is_not_read(tmp_path: Path) -> None:
    """The control dir is the pod's: a link named like the ready file is not followed to another file
    that would pick the format."""
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"protocol": "2"}))
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / protocol.FILE_READY_FOR_SNAPSHOT).symlink_to(outside)
    assert restore_complete.format_for_worker(ctl) == restore_complete.LINES


def test_this_sdks_ready_file_asks_for_what_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    monkeypatch.setenv(protocol.ENV_CONTROL_DIR, str(ctl))
    SnapshotHandshake().signal_ready()
    fmt = restore_complete.format_for_worker(ctl)
    assert fmt == restore_complete.LINES
    restore_complete.write(ctl, DOC, os.getpid(), fmt)
    info = SnapshotHandshake().wait_for_restore(timeout=5)
    assert info.restored
    assert info.pod_name == "restored-1"
    data = (ctl / protocol.FILE_RESTORE_COMPLETE).read_bytes()
    assert _contract_pid(data) == namespace_pid(os.getpid()) == os.getpid()  # no PID namespace of its own
