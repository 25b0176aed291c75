"""The agent takes either generation's ready file: `ready-for-snapshot` (Dynamo >= 1.3, this SDK) and
`ready-for-checkpoint` (Dynamo <= 1.2.1). A real waiting process; no checkpoint is taken."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamo_snapshot.agent.config import AgentConfig
from dynamo_snapshot.agent.executor import AgentError, Executor
from dynamo_snapshot.agent.runtime import ProcessRuntime, Workload
from dynamo_snapshot.api import protocol
from dynamo_snapshot.artifact import ArtifactStore
from dynamo_snapshot.criu import Criu


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Workload]:
    proc = subprocess.Popen(["sleep", "60"])
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    yield Workload("ns_pod_12345678", proc.pid, ctl)
    proc.kill()
    proc.wait()


@pytest.fixture
def executor(tmp_path: Path) -> Executor:
    criu = Criu(Path("/bin/true"))
    return Executor(
        ProcessRuntime(tmp_path / "control", criu),
        ArtifactStore(tmp_path / "store"),
        criu,
        AgentConfig(node_name="n", runtime="local"),
    )


@pytest.mark.parametrize("name", protocol.FILES_READY)
async def test_either_ready_file_starts_the_checkpoint(
    executor: Executor, worker: Workload, name: str
) -> None:
    waiting = asyncio.create_task(executor.wait_ready(worker, within=10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    (worker.control_dir / name).write_text("ready")
    await asyncio.wait_for(waiting, 5)


async def test_a_worker_that_never_says_ready_times_out_naming_both_files(
    executor: Executor, worker: Workload
) -> None:
    with pytest.raises(AgentError, match="did not write ready-for-snapshot or ready-for-checkpoint"):
        await executor.wait_ready(worker, within=0.5)
