"""`dynamo-snapshot-demo --setup-only`: what it prints must still exist when it is used, so the paths to
the cluster are printed only when the command holds the cluster up (with a stand-in for the stack)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from rich.console import Console

from dynamo_snapshot_dev.demo import command as demo_cmd
from dynamo_snapshot_dev.demo import stack as stack_module


class FakeStack:
    """What `demo --setup-only` uses of the Stack: a cluster whose kubeconfig lives until stop()."""

    made: ClassVar[list[FakeStack]] = []

    def __init__(self, workdir: Path, **_: Any) -> None:
        self.workdir = workdir
        self.node_names = ["real-node"]
        self.cluster: SimpleNamespace | None = None
        self.stopped = False
        FakeStack.made.append(self)

    async def start_cluster(self) -> None:
        kubeconfig = self.workdir / "cluster" / "kubeconfig"
        kubeconfig.parent.mkdir(parents=True)
        kubeconfig.write_text("apiVersion: v1\n")
        self.cluster = SimpleNamespace(
            server="https://127.0.0.1:6443",
            kubeconfig=kubeconfig,
            components=SimpleNamespace(bin_dir=self.workdir / "bin"),
        )

    async def stop(self) -> None:
        assert self.cluster is not None
        self.cluster.kubeconfig.unlink()
        self.stopped = True


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> type[FakeStack]:
    FakeStack.made = []
    monkeypatch.setattr(stack_module, "Stack", FakeStack)
    return FakeStack


def _start(tmp_path: Path, *flags: str) -> tuple[asyncio.Task[int], io.StringIO]:
    args = demo_cmd.build_parser().parse_args(["--setup-only", "--out", str(tmp_path / "out"), *flags])
    out = io.StringIO()
    console = Console(file=out, width=300)
    return asyncio.create_task(demo_cmd._main(args, console, tmp_path / "work")), out


async def test_setup_only_prints_no_paths_it_is_about_to_remove(
    stack: type[FakeStack], tmp_path: Path
) -> None:
    task, out = _start(tmp_path)
    assert await asyncio.wait_for(task, 10) == demo_cmd.EXIT_OK
    assert "ready" in out.getvalue()
    assert "export" not in out.getvalue(), out.getvalue()
    assert "--hold" in out.getvalue(), "it says how to keep the cluster up"
    assert stack.made[0].stopped


async def test_setup_only_with_hold_keeps_the_cluster_up_until_a_signal(
    stack: type[FakeStack], tmp_path: Path
) -> None:
    task, out = _start(tmp_path, "--hold")
    for _ in range(200):
        if "holding" in out.getvalue():
            break
        await asyncio.sleep(0.01)
    text = out.getvalue()
    kubeconfig = stack.made[0].workdir / "cluster" / "kubeconfig"
    assert f"export KUBECONFIG={kubeconfig}" in text, text
    assert "export PATH=" in text
    await asyncio.sleep(0.2)
    assert not task.done(), "it holds"
    assert kubeconfig.exists(), "the printed KUBECONFIG names a file that is there"
    # The handlers are installed by the time it says it holds; SIGTERM then ends the hold, not pytest.
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 10) == demo_cmd.EXIT_OK
    assert stack.made[0].stopped
    assert not kubeconfig.exists()
