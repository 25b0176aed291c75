"""`dynamo-snapshot controller`: run the cluster controller against a kubeconfig or in-cluster config."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from pydantic import Field, model_validator

from dynamo_snapshot.autoscale.autoscaler import Autoscaler
from dynamo_snapshot.autoscale.targets import OperatorDgds, OwnDgds, Targets
from dynamo_snapshot.cli.health import distinct_ports, health_endpoints
from dynamo_snapshot.cli.service import load_settings, run_service
from dynamo_snapshot.controller.config import CONTROLLER_NAME, ControllerConfig, InstallMode
from dynamo_snapshot.controller.install_mode import check_install_mode, kinds_left_to_others
from dynamo_snapshot.controller.manager import Controller
from dynamo_snapshot.controller.webhook_server import WebhookServer
from dynamo_snapshot.kube import Informer, Kube, load_client
from dynamo_snapshot.kube.dgd_versions import DgdVersion
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, SCALING_POLICY


class ControllerCommandConfig(ControllerConfig):
    """ControllerConfig plus what only the process needs (the health endpoints, the restore webhook);
    same YAML file."""

    health_port: int = Field(
        default=8081, ge=0, le=65535, description="/healthz and /readyz; 0 disables them."
    )
    webhook_port: int = Field(
        default=0, ge=0, le=65535, description="HTTPS port of the restore webhook; 0 serves none."
    )
    webhook_cert_dir: str = Field(
        default="/etc/dynamo-snapshot/webhook-certs",
        min_length=1,
        description="Directory of the webhook's tls.crt and tls.key, read again when they change.",
    )

    @model_validator(mode="after")
    def _ports(self) -> ControllerCommandConfig:
        distinct_ports(self.metrics_port, self.health_port)
        for name, port in (("metricsPort", self.metrics_port), ("healthPort", self.health_port)):
            if self.webhook_port and port == self.webhook_port:
                raise ValueError(f"webhookPort and {name} are both {port}: give them different ports")
        return self


# flag dest -> ControllerCommandConfig field
_OVERRIDES = (
    "mode",
    "namespace",
    "workers",
    "resync_seconds",
    "leader_elect",
    "lease_name",
    "lease_namespace",
    "restore_failure_threshold",
    "restore_node_attempts",
    "restore_pending_timeout_seconds",
    "drain_timeout",
    "metrics_port",
    "autoscale",
    "prometheus_url",
    "max_policy_replicas",
    "health_port",
    "webhook_port",
    "webhook_cert_dir",
)


def build_controller(
    kube: Kube,
    config: ControllerConfig,
    left_to_others: frozenset[str] = frozenset(),
    dgd_version: DgdVersion | None = None,
) -> Controller:
    """The controller process's parts wired together: the reconcilers and, when `config.autoscale` is on,
    the autoscaler, which runs only while the controller leads: over this controller's DGDs in mode
    standalone, over the Dynamo operator's (through its scaling adapters where installed) in mode
    dynamo-operator."""
    controller = Controller(kube, config, left_to_others=left_to_others, dgd_version=dgd_version)
    if config.autoscale:
        policies = Informer(kube, SCALING_POLICY, namespace=config.namespace)
        # Beside NVIDIA's Dynamo operator the autoscaler keeps read-only caches of its own (the operator's
        # DGDs, scaling adapters and pods), built when it starts leading from what the CRDs serve then.
        targets: Targets = (
            OwnDgds(kube, controller.ctx.dgds, controller.ctx.pods, controller.dgd_version)
            if config.runs_dgds
            else OperatorDgds(kube, config.namespace)
        )
        autoscaler = Autoscaler(
            kube,
            targets=targets,
            policies=policies,
            recorder=controller.ctx.recorder,
            prometheus_url=config.prometheus_url,
            max_policy_replicas=config.max_policy_replicas,
            tick_s=config.autoscale_tick_seconds,
        )
        controller.run_while_leading("autoscaler", autoscaler.run_until, informers=[policies])
    return controller


def _default(setting: str) -> Any:
    # Flags default to None (only a given flag overrides the file), so the help quotes the model's default
    # rather than a copy that could drift from it.
    return ControllerCommandConfig.model_fields[setting].default


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "controller",
        help="run the controller (DGD checkpointRef/Auto mode, restore pods)",
        description="Watch DynamoGraphDeployments and DynamoCheckpoints and run their workers by restore.",
    )
    p.add_argument("--config", type=Path, help="YAML file of settings (see controller/config.yaml)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    _add_mode(p)
    p.add_argument("--namespace", help="watch only this namespace (default: all)")
    p.add_argument(
        "--workers", type=int, help=f"objects reconciled in parallel (default {_default('workers')})"
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        help=f"full re-reconcile period (default {_default('resync_seconds'):g})",
    )
    p.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"hold a Lease so only one replica acts (default {_on_off(_default('leader_elect'))})",
    )
    p.add_argument("--lease-name", help=f"Lease name (default {_default('lease_name')})")
    p.add_argument("--lease-namespace", help=f"Lease namespace (default: {_default('lease_namespace')})")
    p.add_argument(
        "--restore-failure-threshold",
        type=int,
        help=f"failed restores that fail a checkpoint ({_default('restore_failure_threshold')})",
    )
    p.add_argument(
        "--restore-node-attempts",
        type=int,
        help="nodes one replica's restore is tried on before cold start "
        f"({_default('restore_node_attempts')})",
    )
    p.add_argument(
        "--restore-pending-timeout-seconds",
        type=float,
        help="seconds a restore pod may stay unschedulable before a cold start replaces it "
        f"({_default('restore_pending_timeout_seconds'):g})",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        help=f"seconds to finish in-flight work on SIGTERM ({_default('drain_timeout'):g})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help=f"Prometheus metrics port, 0 to disable (default {_default('metrics_port')})",
    )
    _add_autoscale(p)
    p.add_argument(
        "--health-port",
        type=int,
        help=f"/healthz and /readyz port, 0 to disable (default {_default('health_port')})",
    )
    p.add_argument(
        "--webhook-port",
        type=int,
        help="HTTPS port of the restore webhook (pods created with nvidia.com/restore-from), served by "
        f"every replica; 0 serves none (default {_default('webhook_port')})",
    )
    p.add_argument(
        "--webhook-cert-dir",
        help=f"directory of the webhook's tls.crt and tls.key (default {_default('webhook_cert_dir')})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


def _add_autoscale(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"run the DynamoScalingPolicy autoscaler (default {_on_off(_default('autoscale'))})",
    )
    p.add_argument(
        "--prometheus-url", help=f"Prometheus for policies that name none ({_default('prometheus_url')})"
    )
    p.add_argument(
        "--max-policy-replicas",
        type=int,
        help="the most replicas any DynamoScalingPolicy may set; a maxReplicas above it is capped to it "
        f"(default {_default('max_policy_replicas')})",
    )


def _add_mode(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=[m.value for m in InstallMode],
        help="standalone: run the DynamoGraphDeployments' worker pods; dynamo-operator: leave them to "
        f"NVIDIA's Dynamo operator (default {_default('mode')})",
    )


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def load_config(args: argparse.Namespace) -> ControllerCommandConfig:
    """The settings of `dynamo-snapshot controller ARGS`: the --config file, then the flags given."""
    return load_settings(ControllerCommandConfig, args.config, args, _OVERRIDES)


def run(args: argparse.Namespace) -> int:
    return run_service(
        "controller",
        args,
        lambda: load_config(args),
        lambda config, stop: _main(config, args.kubeconfig, stop),
    )


async def _main(config: ControllerCommandConfig, kubeconfig: str | None, stop: asyncio.Event) -> None:
    if config.metrics_port:
        start_http_server(config.metrics_port)
    async with health_endpoints(config.health_port, starting="connecting to the API server") as health:
        api_client = await load_client(kubeconfig)
        async with api_client:
            kube = Kube(api_client, field_manager=CONTROLLER_NAME)
            dgd_version = await check_install_mode(kube, config.mode)
            left_to_others = await kinds_left_to_others(kube, config.mode)
            controller = build_controller(kube, config, left_to_others, dgd_version)
            if not config.webhook_port:
                health.use(controller.readiness)
                await controller.run_until(stop)
                return
            webhook = WebhookServer(
                kube,
                Path(config.webhook_cert_dir),
                config.webhook_port,
                passes_by=POD_SNAPSHOT.kind in left_to_others,
            )
            health.use(lambda: controller.readiness() or webhook.readiness())
            await _with_webhook(controller, webhook, stop)


async def _with_webhook(controller: Controller, webhook: WebhookServer, stop: asyncio.Event) -> None:
    """Run the controller and the webhook (every replica serves it, leading or not) until ``stop``; when
    either fails, the other is stopped (the controller drains) and the failure is the process's."""

    async def serve() -> None:
        try:
            await webhook.run_until(stop)
        finally:
            stop.set()

    task = asyncio.create_task(serve(), name="restore-webhook")
    try:
        await controller.run_until(stop)
    finally:
        stop.set()
        await task
