"""`dynamo-snapshot agent`'s page settings: flags over the config file, and into the executor it builds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.agent.executor import DEFAULT_RESTORE_SCRATCH
from dynamo_snapshot.cli import agent_cmd
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.cli.service import load_settings
from dynamo_snapshot.controller.runtime import Kube
from dynamo_snapshot.criu.runner import ENV_CRIU


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    async with client.ApiClient(client.Configuration()) as api:
        yield Kube(api)


def _config(tmp: Path, *flags: str, file: str = "") -> agent_cmd.AgentConfig:
    path = tmp / "config.yaml"
    path.write_text("nodeName: n\n" + file)
    args = build_parser().parse_args(["agent", "--config", str(path), *flags])
    return load_settings(agent_cmd.AgentConfig, args.config, args, agent_cmd._FLAGS)


async def test_page_flags_reach_the_executor(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    default = _config(tmp_path)
    assert (default.compress_pages, default.restore_scratch) == (True, DEFAULT_RESTORE_SCRATCH)
    executor = agent_cmd.build(default, kube).executor
    assert (executor.compress_pages, executor.restore_scratch) == (True, DEFAULT_RESTORE_SCRATCH)

    off = _config(tmp_path, "--no-compress-pages", "--restore-scratch", "/mnt/fast")
    assert (off.compress_pages, off.restore_scratch) == (False, Path("/mnt/fast"))
    executor = agent_cmd.build(off, kube).executor
    assert (executor.compress_pages, executor.restore_scratch) == (False, Path("/mnt/fast"))

    from_file = _config(tmp_path, file="compressPages: false\nrestoreScratch: /x\n")
    assert (from_file.compress_pages, from_file.restore_scratch) == (False, Path("/x"))
    assert _config(tmp_path, "--compress-pages", file="compressPages: false\n").compress_pages is True
