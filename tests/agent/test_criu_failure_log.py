"""A checkpoint whose CRIU dump fails names CRIU's log, and that log is there after the agent has discarded
the dump's staging directory (where CRIU wrote it): real CRIU, the host-process runtime, a worker CRIU
refuses to dump (it holds an established TCP connection)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from dynamo_snapshot.agent.errors import AgentError
from dynamo_snapshot.agent.executor import Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.cli.agent_cmd import CRIU_LOGS_DIR, AgentConfig, build
from dynamo_snapshot.criu import Criu

pytestmark = pytest.mark.criu
REPO = Path(__file__).resolve().parents[2]

# Connected to itself over loopback TCP: CRIU refuses the connection without --tcp-established.
CONNECTED_WORKER = r"""
import socket, time
from dynamo_snapshot.workload import SnapshotHandshake
server = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(server.getsockname())
peer, _ = server.accept()
SnapshotHandshake().signal_ready({})
while True:
    time.sleep(1)
"""


def test_the_agent_keeps_criu_logs_under_its_state_root(tmp_path: Path) -> None:
    config = AgentConfig(node_name="n", state_root=tmp_path / "state", runtime="local")
    agent = build(config, kube=None)  # type: ignore[arg-type]  # only its parts are looked at
    assert agent.executor.criu.kept_logs == tmp_path / "state" / CRIU_LOGS_DIR


async def test_a_failed_dump_names_a_log_that_outlives_its_staging_dir(
    criu_bin: Path, tmp_path: Path
) -> None:
    kept = tmp_path / "state" / CRIU_LOGS_DIR
    criu = Criu(criu_bin, kept_logs=kept)
    runtime = ProcessRuntime(tmp_path / "control", criu)
    store = tmp_path / "store"
    config = AgentConfig(node_name="n", runtime="local")
    executor = Executor(runtime, ArtifactStore(store), criu, config, cuda=None, gpus=None)
    spec = WorkloadSpec("source", [sys.executable, "-c", CONNECTED_WORKER], {"PYTHONPATH": str(REPO)})
    source = await runtime.launch(spec)
    try:
        await executor.wait_ready(source, within=60)
        with pytest.raises(AgentError) as err:
            await executor.checkpoint(source, "0123456789abcdef")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(source.pid, signal.SIGKILL)
    message = str(err.value)
    assert message.startswith("CRIU dump failed: criu dump failed")
    named = re.search(r"from the log (\S+):", message)
    assert named is not None, message
    log = Path(named[1])
    assert log.parent == kept
    assert "--tcp-established" in await asyncio.to_thread(log.read_text)
    # Nothing else of the failed dump is left: the staging directory CRIU logged into is gone.
    assert await asyncio.to_thread(lambda: [p for p in store.rglob("*") if p.is_file()]) == []
