"""One source of the controller's settings: the CLI, the shipped config file, the Controller and the
reconcilers' Context must all mean the same values, so a default changed in one place cannot leave a stale
copy behind in another."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
import yaml
from kubernetes_asyncio import client

from dynamo_snapshot.cli import controller_cmd
from dynamo_snapshot.cli.controller_cmd import build_controller
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.cli.service import load_settings
from dynamo_snapshot.controller.config import ControllerConfig
from dynamo_snapshot.kube import Kube
from tests.helpers.controller_context import bare_context

REPO = Path(__file__).resolve().parents[2]
# Settings the shipped file sets on purpose to something other than the model's default.
DELIBERATE = {"leaseNamespace"}  # the chart's namespace, not "default"


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    # Nothing is sent: the Controller only needs a client to build its informers.
    async with client.ApiClient(client.Configuration()) as api:
        yield Kube(api)


def _settings(*argv: str) -> controller_cmd.ControllerCommandConfig:
    args = build_parser().parse_args(["controller", *argv])
    return load_settings(controller_cmd.ControllerCommandConfig, args.config, args, controller_cmd._OVERRIDES)


def _subparser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return cast(argparse.ArgumentParser, sub.choices["controller"])


def test_a_context_built_without_settings_has_the_controller_defaults() -> None:
    # Tests and benchmarks build a Context without settings: it must not carry defaults of its own.
    ctx = bare_context()
    assert ctx.settings == ControllerConfig()


async def test_the_reconcilers_read_the_loaded_config_itself(kube: Kube) -> None:
    config = _settings(
        "--restore-failure-threshold",
        "5",
        "--restore-node-attempts",
        "4",
        "--restore-pending-timeout-seconds",
        "7.5",
        "--no-leader-elect",
        "--no-autoscale",
    )
    controller = build_controller(kube, config)
    assert controller.ctx.settings is config
    assert controller.ctx.settings.restore_failure_threshold == 5
    assert controller.ctx.settings.restore_node_attempts == 4
    assert controller.ctx.settings.restore_pending_timeout_seconds == 7.5


async def test_the_autoscaler_is_wired_in_only_when_configured(kube: Kube) -> None:
    def kinds(config: controller_cmd.ControllerCommandConfig) -> list[str]:
        return [inf.kind.kind for inf in build_controller(kube, config).informers]

    # Its policies' cache counts in readiness (caches synced) like the reconcilers' own.
    assert "DynamoScalingPolicy" in kinds(_settings("--no-leader-elect"))
    assert "DynamoScalingPolicy" not in kinds(_settings("--no-leader-elect", "--no-autoscale"))


def test_no_flag_given_means_the_model_defaults() -> None:
    assert _settings() == controller_cmd.ControllerCommandConfig()
    fields = controller_cmd.ControllerCommandConfig.model_fields
    dests = {a.dest: a for a in _subparser()._actions}
    for name in controller_cmd._OVERRIDES:
        assert name in fields, f"flag {name} overrides no setting"
        # A flag default other than None would override the config file with a second copy of a default.
        assert dests[name].default is None, name


def test_the_help_quotes_the_model_defaults() -> None:
    defaults = controller_cmd.ControllerCommandConfig()
    helps = {a.dest: a.help or "" for a in _subparser()._actions}
    for name in (
        "workers",
        "resync_seconds",
        "lease_name",
        "lease_namespace",
        "restore_failure_threshold",
        "restore_node_attempts",
        "restore_pending_timeout_seconds",
        "drain_timeout",
        "metrics_port",
        "prometheus_url",
        "max_policy_replicas",
        "health_port",
    ):
        value = getattr(defaults, name)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        assert shown in helps[name], f"--{name.replace('_', '-')}: {helps[name]!r} does not say {shown}"


def test_the_shipped_config_file_repeats_the_defaults_exactly() -> None:
    shipped = yaml.safe_load((REPO / "controller" / "config.yaml").read_text())
    defaults = controller_cmd.ControllerCommandConfig().model_dump(by_alias=True)
    assert set(shipped) == set(defaults), "controller/config.yaml should list every setting"
    drifted = {k: (v, defaults[k]) for k, v in shipped.items() if k not in DELIBERATE and v != defaults[k]}
    assert drifted == {}, "controller/config.yaml and ControllerConfig disagree (file, model)"
