"""`dynamo-snapshot agent`'s page and weights-check settings: flags over the config file, and into the
executor it builds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from dynamo_snapshot.agent.config import AgentConfig, settings_fields
from dynamo_snapshot.agent.executor import DEFAULT_RESTORE_SCRATCH
from dynamo_snapshot.cli import agent_cmd
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.cli.service import ConfigError, load_settings
from dynamo_snapshot.criu.runner import ENV_CRIU
from dynamo_snapshot.kube import Kube

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    async with client.ApiClient(client.Configuration()) as api:
        yield Kube(api)


def _agent_helps() -> dict[str, str]:
    """Each `dynamo-snapshot agent` option's help, by its setting's name."""
    agent = next(
        a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith(" agent")
    )
    return {a.dest: a.help or "" for a in agent._actions}


def _config(tmp: Path, *flags: str, file: str = "") -> agent_cmd.AgentConfig:
    path = tmp / "config.yaml"
    path.write_text("nodeName: n\n" + file)
    args = build_parser().parse_args(["agent", "--config", str(path), *flags])
    return load_settings(agent_cmd.AgentConfig, args.config, args, agent_cmd._FLAGS)


async def test_page_flags_reach_the_executor(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here

    def pages(config: AgentConfig) -> tuple[bool, Path]:
        return config.checkpoint.compress_pages, config.restore.restore_scratch

    default = _config(tmp_path)
    assert pages(default) == (False, DEFAULT_RESTORE_SCRATCH)
    assert pages(agent_cmd.build(default, kube).executor.config) == (False, DEFAULT_RESTORE_SCRATCH)

    on = _config(tmp_path, "--compress-pages", "--restore-scratch", "/mnt/fast")
    assert pages(on) == (True, Path("/mnt/fast"))
    assert pages(agent_cmd.build(on, kube).executor.config) == (True, Path("/mnt/fast"))

    from_file = _config(tmp_path, file="compressPages: true\nrestoreScratch: /x\n")
    assert pages(from_file) == (True, Path("/x"))
    in_sections = _config(tmp_path, file="checkpoint: {compressPages: true}\nrestore: {restoreScratch: /x}\n")
    assert pages(in_sections) == (True, Path("/x"))
    no = _config(tmp_path, "--no-compress-pages", file="checkpoint: {compressPages: true}\n")
    assert no.checkpoint.compress_pages is False


async def test_weights_check_idle_io_reaches_the_executor(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    default = _config(tmp_path)
    assert default.restore.weights_check_idle_io is True
    assert agent_cmd.build(default, kube).executor.config.restore.weights_check_idle_io is True

    off = _config(tmp_path, "--no-weights-check-idle-io")
    assert off.restore.weights_check_idle_io is False
    assert agent_cmd.build(off, kube).executor.config.restore.weights_check_idle_io is False

    assert _config(tmp_path, file="weightsCheckIdleIo: false\n").restore.weights_check_idle_io is False
    on = _config(tmp_path, "--weights-check-idle-io", file="restore: {weightsCheckIdleIo: false}\n")
    assert on.restore.weights_check_idle_io is True


async def test_restore_huge_pages_reaches_criu(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    assert agent_cmd.build(_config(tmp_path), kube).executor.criu.restore_huge_pages is True
    for config in (
        _config(tmp_path, "--no-restore-huge-pages"),
        _config(tmp_path, file="restore: {restoreHugePages: false}\n"),
    ):
        assert config.restore.restore_huge_pages is False
        agent = agent_cmd.build(config, kube)
        # The executor's CRIU is the runtime's: the restores it runs read the setting.
        assert agent.executor.criu.restore_huge_pages is False
        assert getattr(agent.executor.runtime, "criu", None) is agent.executor.criu


async def test_cache_settings_reach_the_executor(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    assert agent_cmd.build(_config(tmp_path), kube).executor.cache is None

    on = _config(tmp_path, "--cache-root", str(tmp_path / "cache"), "--cache-max-size", "50Gi")
    cache = agent_cmd.build(on, kube).executor.cache
    assert cache is not None
    assert (cache.root, cache.max_bytes, cache.min_free_bytes) == (tmp_path / "cache", 50 << 30, 10 << 30)

    helps = _agent_helps()
    # The defaults the help states are the model's.
    assert helps["cache_max_size"].endswith("(default 200.0GiB)"), helps["cache_max_size"]
    assert helps["cache_min_free"].endswith("(default 10.0GiB)"), helps["cache_min_free"]

    from_file = _config(tmp_path, file="cacheRoot: /nvme/c\ncacheMaxSize: 1.5TiB\ncacheMinFree: 500GB\n")
    assert (from_file.cache.cache_max_size, from_file.cache.cache_min_free) == (
        int(1.5 * (1 << 40)),
        500 * 10**9,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cache-root", "/var/lib/dynamo-snapshot/artifacts"], "must be a directory of its own"),
        (["--cache-root", "/var/lib/dynamo-snapshot"], "must be a directory of its own"),
        (["--cache-root", "/c", "--cache-max-size", "lots"], "could not parse value and unit"),
        (["--cache-root", "/c", "--cache-max-size", "0"], "cacheMaxSize must be more than 0 bytes"),
    ],
)
def test_bad_cache_settings_are_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *flags)


def test_shipped_config_carries_the_agent_switches() -> None:
    """agent/config.yaml is what the image runs with: the keys themselves, as the model's defaults would
    hide a missing line."""
    shipped = yaml.safe_load((REPO / "agent" / "config.yaml").read_text())
    expected = {
        ("restore", "weightsCheckIdleIo"): True,
        ("checkpoint", "dropZeroPages"): "off",
        ("checkpoint", "compressPages"): False,
    }
    for (section, key), value in expected.items():
        assert shipped[section][key] == value, key
    config = agent_cmd.AgentConfig.model_validate({**shipped, "nodeName": "n"})
    switches = (
        config.restore.weights_check_idle_io,
        config.checkpoint.drop_zero_pages,
        config.checkpoint.compress_pages,
    )
    assert switches == (True, "off", False)


def test_every_bool_setting_has_a_switch_whose_help_gives_its_default() -> None:
    helps = _agent_helps()
    switches = [
        (n, m.model_fields[n]) for _, n, m in settings_fields() if m.model_fields[n].annotation is bool
    ]
    assert len(switches) >= 5
    for name, info in switches:
        default = info.default
        assert name in agent_cmd._FLAGS, name
        assert helps[name].endswith(f"(default {'on' if default else 'off'})"), (name, helps[name])
        args = build_parser().parse_args(["agent", f"--no-{name.replace('_', '-')}"])
        assert getattr(args, name) is False


def test_every_setting_is_a_flag_with_its_type_and_default() -> None:
    """The flags are the model's settings: a value given on the command line reaches the same setting a
    file would set, and the help states the model's default."""
    helps = _agent_helps()
    for section, name, model in settings_fields():
        assert name in helps, name
        info = model.model_fields[name]
        assert info.description, f"{section}.{name} has no description for its help"
        assert helps[name].startswith(info.description), name
    args = build_parser().parse_args(
        ["agent", "--node-name", "n", "--ready-timeout-seconds", "7.5", "--writable-binds", "/a", "/b"]
    )
    config = load_settings(AgentConfig, None, args, agent_cmd._FLAGS)
    assert config.timeouts.ready_timeout_seconds == 7.5
    assert config.containers.writable_binds == ["/a", "/b"]
    assert config.containers.host_binds == ["/usr", "/etc", "/opt"]


def test_an_unknown_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dropZeroPage: no such setting"):
        _config(tmp_path, file="dropZeroPage: true\n")
    with pytest.raises(ConfigError, match=r"\('checkpoint', 'zeroPages'\): Extra inputs are not permitted"):
        _config(tmp_path, file="checkpoint: {zeroPages: true}\n")


async def test_restore_readers_reach_criu(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CRIU, "/bin/true")  # build() resolves CRIU; none runs here
    assert agent_cmd.build(_config(tmp_path), kube).executor.criu.restore_readers == 8
    for config in (
        _config(tmp_path, "--restore-readers", "1"),
        _config(tmp_path, file="restore: {restoreReaders: 1}\n"),
    ):
        assert agent_cmd.build(config, kube).executor.criu.restore_readers == 1
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="restore_readers"):
            _config(tmp_path, "--restore-readers", bad)
    with pytest.raises(SystemExit):
        _config(tmp_path, "--restore-readers", "two")
