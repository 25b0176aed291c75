"""The Helm chart rendered by the real helm binary: lint, the objects each value set produces, the schema's
refusals, and drift against the code it deploys (CRDs, config models, RBAC, the agent's annotations)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

import dynamo_snapshot
from dynamo_snapshot.agent import watcher
from dynamo_snapshot.agent.privileges import (
    CAPABILITY_BITS,
    CONTAINERD_DEFAULT_CAPABILITIES,
    OTHER_USER_CAPABILITIES,
    REQUIRED_CAPABILITIES,
)
from dynamo_snapshot.agent.runtime.runc import DEFAULT_HOST_BINDS
from dynamo_snapshot.api import crdgen, protocol
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from dynamo_snapshot.cli.agent_cmd import AgentConfig
from dynamo_snapshot.cli.controller_cmd import ControllerCommandConfig
from dynamo_snapshot.controller.config import InstallMode
from dynamo_snapshot_dev.localcluster.realnode import NO_IO_URING_SECCOMP
from tests.helm import rbac
from tests.helm.chart import (
    CHART,
    REPO,
    WEBHOOK_OFF,
    Obj,
    helm,
    kinds,
    lint,
    one,
    render,
    render_text,
    rule_triples,
    template,
)

PVC_ON = {"artifacts": {"persistence": {"enabled": True, "storageClass": "nfs-rwx", "size": "2Ti"}}}
SERVICE_MONITOR_ON = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
RUNTIME_LOCAL = {"agent": {"runtime": "local", "launchWorkloads": True}}
WATCH_ONE = {"controller": {"watchNamespace": "team-a", "autoscale": False}}
# Paths a volume name cannot simply be made of: capitals, underscores, spaces, one readable part for two
# paths (a_b, a-b), none at all, more than 63 characters, dotted components.
HOST_BINDS = [
    "/srv/models",
    "/home/dev/Checkout_v2",
    "/data/a_b",
    "/data/a-b",
    "/___",
    "/mnt/" + "x" * 80,
    "/mnt/.hidden/..odd/...",
]
WRITABLE_BINDS = ["/srv/endpoints", "/scratch/run #1: w"]
LAUNCH_WITH_BINDS = {
    "agent": {
        "runtime": "runc",
        "launchWorkloads": True,
        "hostBinds": HOST_BINDS,
        "writableBinds": WRITABLE_BINDS,
    }
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
MINIMAL = {
    "rbac": {"create": False},
    "serviceAccount": {
        "controller": {"create": False, "name": "own-controller"},
        "agent": {"create": False, "name": "own-agent"},
    },
    "agent": {"admissionPolicy": {"enabled": False}, "seccompProfile": {"install": False}, "metricsPort": 0},
    "controller": {"metricsPort": 0, "leaderElect": False},
    **WEBHOOK_OFF,
}
VALUE_SETS = {
    "defaults": None,
    "pvc": PVC_ON,
    "service-monitor": SERVICE_MONITOR_ON,
    "runtime-local": RUNTIME_LOCAL,
    "watch-one-namespace": WATCH_ONE,
    "minimal": MINIMAL,
    "launch-with-binds": LAUNCH_WITH_BINDS,
    "dynamo-operator": {"mode": "dynamo-operator"},
}
DGD_CRD_FILE = "nvidia.com_dynamographdeployments.yaml"


def _config(objs: list[Obj], component: str) -> dict[str, Any]:
    cm = one(objs, "ConfigMap", f"-{component}")
    data = yaml.safe_load(cm["data"]["config.yaml"])
    assert isinstance(data, dict)
    return data


def _container(workload: Obj, name: str) -> Obj:
    pod = workload["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


# --------------------------------------------------------------------------- lint and versions


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean(values: dict[str, Any] | None) -> None:
    proc = lint(values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout, proc.stdout
    assert "[ERROR]" not in proc.stdout, proc.stdout


def test_chart_metadata_follows_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == dynamo_snapshot.__version__


def test_chart_crds_are_the_generated_crds() -> None:
    """helm/dynamo-snapshot/crds/ holds copies of crds/ (itself generated from the models), but for the
    DynamoGraphDeployment CRD, whose copy is in files/ (a template renders it, in mode standalone only):
    same files, same bytes. After `python -m dynamo_snapshot.api.crdgen`, copy crds/*.yaml there."""
    chart_crds = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    chart_files = {p.name: p.read_bytes() for p in (CHART / "files").glob("*.yaml")}
    assert sorted(chart_files) == [DGD_CRD_FILE]
    assert DGD_CRD_FILE not in chart_crds, "Helm would install the DGD CRD in every mode from crds/"
    chart_copies = {**chart_crds, **chart_files}
    repo_crds = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    assert sorted(chart_copies) == sorted(repo_crds), "the chart's copies and crds/ name different files"
    stale = [name for name in repo_crds if chart_copies[name] != repo_crds[name]]
    assert not stale, (
        f"the chart's copies differ from crds/ in {stale}: cp crds/*.yaml helm/dynamo-snapshot/crds/ and "
        f"crds/{DGD_CRD_FILE} helm/dynamo-snapshot/files/"
    )
    rendered = crdgen.render_crds()
    assert sorted(rendered) == sorted(chart_copies)
    assert all(chart_copies[n].decode() == text for n, text in rendered.items())


def _dgd_crds(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] == "CustomResourceDefinition"]


def test_the_dgd_crd_template_is_the_generated_crd_plus_the_helm_wrapping() -> None:
    """What Helm installs in mode standalone is the models' CRD, field for field, with its ownership label
    beside the chart's, and kept on uninstall; an edit of the template or of files/ that changes the CRD
    fails here."""
    objs = render(WEBHOOK_OFF)
    [crd] = _dgd_crds(objs)
    assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    chart_labels = one(objs, "Deployment", "-controller")["metadata"]["labels"]
    labels = crd["metadata"].pop("labels")
    assert labels == {
        **{k: v for k, v in chart_labels.items() if k != "app.kubernetes.io/component"},
        "app.kubernetes.io/component": "crds",
        protocol.LABEL_CRD_OWNER: protocol.MANAGED_BY_VALUE,
    }
    expected = crdgen.generated_crd(DynamoGraphDeployment)
    assert expected["metadata"].pop("labels") == {protocol.LABEL_CRD_OWNER: protocol.MANAGED_BY_VALUE}
    assert crd == expected


def test_the_dgd_crd_template_fails_when_its_file_drifts(tmp_path: Path) -> None:
    """The comparison above is not vacuous: a copy of the chart whose files/ CRD lost a field renders a
    CRD that differs from the models'."""
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    drifted = yaml.safe_load((copy / "files" / DGD_CRD_FILE).read_text())
    del drifted["spec"]["versions"][0]["subresources"]
    (copy / "files" / DGD_CRD_FILE).write_text(yaml.safe_dump(drifted))
    proc = helm("template", "t", str(copy), "--set", "webhook.enabled=false")
    assert proc.returncode == 0, proc.stderr
    [crd] = _dgd_crds([d for d in yaml.safe_load_all(proc.stdout) if d])
    assert crd["spec"] != crdgen.generated_crd(DynamoGraphDeployment)["spec"]


def test_mode_dynamo_operator_installs_no_dgd_crd_and_grants_what_its_parts_call() -> None:
    objs = render({"mode": "dynamo-operator", **WEBHOOK_OFF})
    assert _dgd_crds(objs) == []
    assert rule_triples(one(objs, "ClusterRole", "-controller")) == rbac.CONTROLLER_DYNAMO_OPERATOR
    # The CRD is read all the same: the controller checks at start whose it is; and the scaling adapters'.
    dgdsa = ("apiextensions.k8s.io", "customresourcedefinitions", rbac.DGDSA_CRD, "get")
    assert rule_triples(
        one(objs, "ClusterRole", "-controller-cluster-scoped")
    ) == rbac.CONTROLLER_CLUSTER_SCOPED | {dgdsa}
    # Without the autoscaler: no DGD writes, no adapters, no policies.
    quiet = render({"mode": "dynamo-operator", "controller": {"autoscale": False}, **WEBHOOK_OFF})
    assert rule_triples(one(quiet, "ClusterRole", "-controller")) == {
        g
        for g in rbac.CONTROLLER_DYNAMO_OPERATOR
        if g not in rbac.OPERATOR_AUTOSCALER - rbac.OPERATOR_CHAIN
        and not g[1].startswith("dynamoscalingpolicies")
    }
    assert (
        rule_triples(one(quiet, "ClusterRole", "-controller-cluster-scoped"))
        == rbac.CONTROLLER_CLUSTER_SCOPED
    )
    config = ControllerCommandConfig.model_validate(_config(objs, "controller"))
    assert config.mode is InstallMode.DYNAMO_OPERATOR
    assert not config.runs_dgds
    standalone = ControllerCommandConfig.model_validate(_config(render(WEBHOOK_OFF), "controller"))
    assert standalone.mode is InstallMode.STANDALONE


def test_mode_values_are_the_controllers() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["mode"]["enum"] == [m.value for m in InstallMode]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["mode"] == InstallMode.STANDALONE
    proc = template({"mode": "operator"})
    assert proc.returncode != 0
    assert "at '/mode': value must be one of 'standalone', 'dynamo-operator'" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- defaults


def test_defaults_render_every_component_and_nothing_optional() -> None:
    objs = render()
    assert kinds(objs) == sorted(
        ["ServiceAccount"] * 2
        # The DynamoGraphDeployment CRD (mode standalone); the other CRDs are in crds/.
        + ["CustomResourceDefinition"]
        + ["ConfigMap"] * 3
        + ["ClusterRole"] * 3
        + ["ClusterRoleBinding"] * 3
        + ["Role", "RoleBinding", "Service", "Service", "DaemonSet", "Deployment"]
        + ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
        # The restore webhook: its TLS Secret, its Service and the configuration that sends pods to it.
        + ["Secret", "Service", "MutatingWebhookConfiguration"]
    )
    for o in objs:
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        # The controller's informers select worker pods by managed-by=dynamo-snapshot: never ours.
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] != protocol.MANAGED_BY_VALUE


def test_controller_deployment() -> None:
    objs = render(release="rel", namespace="snap-system")
    deploy = one(objs, "Deployment", "-controller")
    pod = deploy["spec"]["template"]["spec"]
    c = _container(deploy, "controller")
    assert c["command"] == ["dynamo-snapshot", "controller", "--config", "/etc/dynamo-snapshot/config.yaml"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081, "webhook": 9443}
    # The restore webhook is served with the chart's certificate, mounted where the flag points.
    args = c["args"]
    assert args[args.index("--webhook-port") + 1] == "9443"
    cert_dir = args[args.index("--webhook-cert-dir") + 1]
    cert_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == cert_dir)
    cert_volume = next(v for v in pod["volumes"] if v["name"] == cert_mount["name"])
    assert cert_volume["secret"]["secretName"] == "rel-dynamo-snapshot-controller-webhook-tls"
    assert one(objs, "Secret", "-controller-webhook-tls")["metadata"]["namespace"] == "snap-system"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert set(c["resources"]) == {"requests", "limits"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "rel-dynamo-snapshot-controller"
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/dynamo-snapshot")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == one(objs, "ConfigMap", "-controller")["metadata"]["name"]
    assert "checksum/config" in deploy["spec"]["template"]["metadata"]["annotations"]

    # The rendered file is read by the real settings model, which refuses unknown keys.
    config = ControllerCommandConfig.model_validate(_config(objs, "controller"))
    assert config.leader_elect is True
    assert (config.lease_name, config.lease_namespace) == ("dynamo-snapshot-controller", "snap-system")
    assert config.namespace is None
    assert (config.metrics_port, config.health_port) == (8080, 8081)


def test_max_policy_replicas_reaches_the_controller() -> None:
    default = ControllerCommandConfig.model_validate(_config(render(), "controller"))
    assert default.max_policy_replicas == ControllerCommandConfig().max_policy_replicas
    objs = render({"controller": {"maxPolicyReplicas": 64}})
    assert ControllerCommandConfig.model_validate(_config(objs, "controller")).max_policy_replicas == 64
    refused = template({"controller": {"maxPolicyReplicas": 0}})
    assert refused.returncode != 0
    assert "maxPolicyReplicas" in refused.stderr, refused.stderr


def test_agent_capabilities_are_linux_ones() -> None:
    wrong = template({"agent": {"capabilities": ["SYS_ADMIN", "CAP_NET_ADMIN"]}})
    assert wrong.returncode != 0
    assert "capabilities" in wrong.stderr
    schema = json.loads((CHART / "values.schema.json").read_text())
    items = schema["properties"]["agent"]["properties"]["capabilities"]["items"]
    assert items["enum"] == list(CAPABILITY_BITS)


def test_agent_privileged_on_request_and_the_nvidia_runtime_class() -> None:
    ds = one(render({"agent": {"privileged": True, "runtimeClassName": "nvidia"}}), "DaemonSet", "-agent")
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    agent = _container(ds, "agent")
    assert agent["securityContext"] == {"privileged": True}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"


def test_agent_daemonset(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render()
    ds = one(objs, "DaemonSet", "-agent")
    pod = ds["spec"]["template"]["spec"]
    agent = _container(ds, "agent")
    assert pod["hostPID"] is True
    assert "runtimeClassName" not in pod
    assert agent["securityContext"] == {
        "capabilities": {"drop": ["ALL"], "add": agent["securityContext"]["capabilities"]["add"]},
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }
    # Every capability the agent asks for (it refuses to start without the required ones), nothing else.
    assert agent["securityContext"]["capabilities"]["add"] == [
        *REQUIRED_CAPABILITIES,
        *OTHER_USER_CAPABILITIES,
        *CONTAINERD_DEFAULT_CAPABILITIES,
    ]
    assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["nodeSelector"] == {protocol.LABEL_GPU_PRESENT: "true"}
    assert agent["command"] == ["dynamo-snapshot", "agent", "--config", "/etc/dynamo-snapshot/config.yaml"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"metrics": 9090, "health": 8082}
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in agent["volumeMounts"]}
    for path in (
        "/run/containerd",
        "/var/lib/containerd",
        "/var/lib/kubelet",
        "/sys/fs/cgroup",
        "/var/lib/dynamo-snapshot/artifacts",
        "/var/lib/dynamo-snapshot/control",
        "/var/lib/dynamo-snapshot/runtime",
    ):
        assert mounted[path]["hostPath"]["path"] == path, path

    monkeypatch.setenv("NODE_NAME", "gpu-0")
    config = AgentConfig.model_validate(_config(objs, "agent"))
    containers = config.containers
    assert (containers.runtime, str(containers.runc_root)) == ("containerd", "/run/containerd/runc/k8s.io")
    assert mounted["/run/containerd"]["hostPath"]["path"] == "/run/containerd"
    assert (config.observability.metrics_port, config.observability.health_port) == (9090, 8082)
    assert str(config.store.artifact_root) == "/var/lib/dynamo-snapshot/artifacts"
    assert str(config.node.control_root) in mounted
    assert str(config.node.state_root) in mounted
    # Pages stored as CRIU wrote them unless turned on (BENCHMARKS.md, compressed pages A/B).
    assert config.checkpoint.compress_pages is False
    # The key itself: the model's default would hide a missing line.
    assert _config(objs, "agent")["restore"]["weightsCheckIdleIo"] is True
    assert config.restore.weights_check_idle_io is True
    assert mounted[str(config.restore.restore_scratch)]["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": "8Gi",
    }
    assert agent["resources"]["limits"]["memory"] == "16Gi"

    changed = render(
        {
            "agent": {
                "compressPages": True,
                "weightsCheckIdleIo": False,
                "restoreScratch": {"path": "/scratch", "sizeLimit": "2Gi"},
            }
        }
    )
    config = AgentConfig.model_validate(_config(changed, "agent"))
    assert (config.checkpoint.compress_pages, str(config.restore.restore_scratch)) == (True, "/scratch")
    assert config.restore.weights_check_idle_io is False
    agent = _container(one(changed, "DaemonSet", "-agent"), "agent")
    volumes = {
        v["name"]: v for v in one(changed, "DaemonSet", "-agent")["spec"]["template"]["spec"]["volumes"]
    }
    mounted = {m["mountPath"]: volumes[m["name"]] for m in agent["volumeMounts"]}
    assert mounted["/scratch"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


def test_node_cache_is_off_by_default_and_mounted_where_the_agent_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-0")

    def agent_of(objs: list[Obj]) -> tuple[AgentConfig, dict[str, Obj]]:
        ds = one(objs, "DaemonSet", "-agent")
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        mounts = _container(ds, "agent")["volumeMounts"]
        return AgentConfig.model_validate(_config(objs, "agent")), {
            m["mountPath"]: volumes[m["name"]] for m in mounts
        }

    config, mounted = agent_of(render())
    assert config.cache.cache_root is None
    assert "/var/lib/dynamo-snapshot/cache" not in mounted

    config, mounted = agent_of(
        render({"agent": {"cache": {"enabled": True, "hostPath": "/nvme/snap-cache", "maxSize": "1.5Ti"}}})
    )
    assert str(config.cache.cache_root) == "/nvme/snap-cache"
    assert (config.cache.cache_max_size, config.cache.cache_min_free) == (int(1.5 * (1 << 40)), 10 << 30)
    assert mounted["/nvme/snap-cache"]["hostPath"] == {
        "path": "/nvme/snap-cache",
        "type": "DirectoryOrCreate",
    }


@pytest.mark.parametrize(
    ("component", "kind", "container", "model"),
    [
        ("controller", "Deployment", "controller", ControllerCommandConfig),
        ("agent", "DaemonSet", "agent", AgentConfig),
    ],
)
def test_health_port_follows_the_value(
    component: str,
    kind: str,
    container: str,
    model: type[ControllerCommandConfig] | type[AgentConfig],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port other than the defaults (which the settings models share) must reach the process's config,
    the container's port and both probes."""
    objs = render({component: {"healthPort": 9443}})
    data = _config(objs, component)
    monkeypatch.setenv("NODE_NAME", "gpu-0")
    settings = model.model_validate(data)
    if isinstance(settings, AgentConfig):
        assert data["observability"]["healthPort"] == 9443
        assert settings.observability.health_port == 9443
    else:
        assert data["healthPort"] == 9443
        assert settings.health_port == 9443
    c = _container(one(objs, kind, f"-{component}"), container)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == 9443
    for probe in ("livenessProbe", "readinessProbe"):
        port = c[probe]["httpGet"]["port"]
        assert ports.get(port, port) == 9443, f"{probe} port {port!r}"


def test_seccomp_profile_is_installed_for_workloads() -> None:
    objs = render()
    cm = one(objs, "ConfigMap", "-seccomp")
    profile = json.loads(cm["data"]["dynamo-snapshot-no-io-uring.json"])
    # The real node of the local cluster installs the same profile, as the agent's init container would.
    assert profile == NO_IO_URING_SECCOMP
    assert NO_IO_URING_SECCOMP == {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {
                "names": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 38,
            }
        ],
    }
    ds = one(objs, "DaemonSet", "-agent")
    pod = ds["spec"]["template"]["spec"]
    init = _container(ds, "install-seccomp-profile")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in init["volumeMounts"]}
    assert mounts["/profile"]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounts["/host-seccomp"]["hostPath"]["path"] == "/var/lib/kubelet/seccomp"
    script = init["command"][-1]
    assert script.rstrip().endswith("/host-seccomp/profiles/dynamo-snapshot-no-io-uring.json"), (
        "the profile must land at <kubelet root>/seccomp/profiles/<file>, where Localhost profiles are read"
    )
    assert "mv -f" in script


# --------------------------------------------------------------------------- optional parts


def test_pvc_toggle() -> None:
    assert not [o for o in render() if o["kind"] == "PersistentVolumeClaim"]
    objs = render(PVC_ON)
    pvc = one(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["storageClassName"] == "nfs-rwx"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Ti"
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    artifacts = next(v for v in pod["volumes"] if v["name"] == "artifacts")
    assert artifacts == {"name": "artifacts", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}}

    existing = render({"artifacts": {"persistence": {"enabled": True, "existingClaim": "shared-store"}}})
    assert not [o for o in existing if o["kind"] == "PersistentVolumeClaim"]
    pod = one(existing, "DaemonSet")["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == "artifacts")["persistentVolumeClaim"]
    assert claim["claimName"] == "shared-store"


def test_service_monitor_toggle() -> None:
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]
    objs = render(SERVICE_MONITOR_ON)
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    services = [o for o in objs if o["kind"] == "Service"]
    scraped: list[str] = []
    for sm in monitors:
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["metadata"]["labels"]["release"] == "kps"
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["port"] == "metrics"
        # The Prometheus operator scrapes the named port of the Services the labels select: the
        # controller's webhook Service shares its labels but has no such port, so is not scraped.
        selected = [
            s
            for s in services
            if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            and endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert len(selected) == 1, "each ServiceMonitor scrapes exactly one metrics Service"
        assert selected[0]["metadata"]["name"].endswith("-metrics")
        scraped.append(selected[0]["metadata"]["name"])
    assert sorted(scraped) == ["t-dynamo-snapshot-agent-metrics", "t-dynamo-snapshot-controller-metrics"]


def test_runtime_local() -> None:
    objs = render(RUNTIME_LOCAL)
    data = _config(objs, "agent")
    assert (data["containers"]["runtime"], data["containers"]["launchWorkloads"]) == ("local", True)
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert not paths & {"/run/containerd", "/run/runc"}, "the local runtime runs no containers"


def _agent_mounts(objs: list[Obj]) -> dict[str, tuple[Obj, Obj]]:
    """The agent container's mounts by path: (volumeMount, volume)."""
    ds = one(objs, "DaemonSet", "-agent")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    mounts = _container(ds, "agent")["volumeMounts"]
    assert len({m["mountPath"] for m in mounts}) == len(mounts), "two mounts at one path"
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in mounts}


def test_launched_workloads_get_their_binds_mounted_in_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """runc binds the workers' directories from the agent's own mount namespace: each must be mounted there,
    from the host, at the same path; read-only ones read-only."""
    objs = render(LAUNCH_WITH_BINDS)
    pod = one(objs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    names = [v["name"] for v in pod["volumes"]]
    assert len(set(names)) == len(names), names
    for name in names:
        assert DNS_LABEL.match(name), f"{name!r} is not a DNS-1123 label of at most 63 characters"

    mounts = _agent_mounts(objs)
    defaults = _agent_mounts(render())
    assert set(mounts) == set(defaults) | set(HOST_BINDS) | set(WRITABLE_BINDS)
    for path in HOST_BINDS:
        mount, volume = mounts[path]
        assert mount.get("readOnly") is True, path
        assert volume["hostPath"] == {"path": path, "type": "Directory"}, path
        assert volume["name"].startswith("bind-ro-")
    for path in WRITABLE_BINDS:
        mount, volume = mounts[path]
        assert mount.get("readOnly", False) is False, path
        assert volume["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}, path
        assert volume["name"].startswith("bind-rw-")
    assert mounts["/srv/models"][1]["name"].startswith("bind-ro-srv-models-"), "names read as their path"

    # A name comes from its path alone: reordering the lists renames no volume.
    reordered = render(
        {
            "agent": {
                "runtime": "runc",
                "launchWorkloads": True,
                "hostBinds": HOST_BINDS[::-1],
                "writableBinds": WRITABLE_BINDS[::-1],
            }
        }
    )
    again = _agent_mounts(reordered)
    assert {p: v["name"] for p, (_, v) in again.items()} == {p: v["name"] for p, (_, v) in mounts.items()}

    # The agent is told the same: the image's system directories, then the host's.
    monkeypatch.setenv("NODE_NAME", "gpu-0")
    config = AgentConfig.model_validate(_config(objs, "agent"))
    assert config.containers.host_binds == [*DEFAULT_HOST_BINDS, *HOST_BINDS]
    assert config.containers.writable_binds == WRITABLE_BINDS


def test_binds_are_mounted_only_for_launched_runc_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    binds = {"hostBinds": HOST_BINDS, "writableBinds": WRITABLE_BINDS}
    for values, without in [
        ({"agent": {**binds, "runtime": "runc"}}, {"agent": {"runtime": "runc"}}),
        ({"agent": binds}, None),
        ({"agent": {**binds, "runtime": "local", "launchWorkloads": True}}, RUNTIME_LOCAL),
    ]:
        objs, plain = render(values), render(without)
        assert _agent_mounts(objs) == _agent_mounts(plain), values
        ds, plain_ds = one(objs, "DaemonSet", "-agent"), one(plain, "DaemonSet", "-agent")
        assert ds["spec"]["template"]["spec"]["volumes"] == plain_ds["spec"]["template"]["spec"]["volumes"]
    # Empty lists render as the chart always has: no hostBinds key (the agent's default), nothing mounted.
    launch = {"agent": {"runtime": "runc", "launchWorkloads": True}, **WEBHOOK_OFF}
    empty = {
        "agent": {"runtime": "runc", "launchWorkloads": True, "hostBinds": [], "writableBinds": []},
        **WEBHOOK_OFF,
    }
    assert render_text(empty) == render_text(launch)
    data = _config(render(), "agent")
    assert "hostBinds" not in data["containers"]
    monkeypatch.setenv("NODE_NAME", "gpu-0")
    assert AgentConfig.model_validate(data).containers.host_binds == list(DEFAULT_HOST_BINDS)


def test_bind_and_mount_paths_the_agent_cannot_use_are_refused() -> None:
    launch: dict[str, Any] = {"runtime": "runc", "launchWorkloads": True}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {**launch, "hostBinds": ["/usr/local/cuda"]},
            "agent.hostBinds: /usr/local/cuda would hide the agent container's own /usr",
        ),
        (
            {"writableBinds": ["/etc/workers"]},
            "agent.writableBinds: /etc/workers would hide the agent container's own /etc",
        ),
        (
            {**launch, "hostBinds": ["/run"]},
            "agent.hostBinds: /run would hide the agent container's own /run",
        ),
        (
            {**launch, "hostBinds": ["/srv"], "writableBinds": ["/srv/endpoints"]},
            "agent.writableBinds: /srv/endpoints is or lies inside the read-only bind /srv",
        ),
        (
            {**launch, "hostBinds": ["/srv/x"], "writableBinds": ["/srv/x"]},
            "agent.writableBinds: /srv/x is or lies inside the read-only bind /srv/x",
        ),
        (
            {**launch, "hostBinds": ["/var/lib/dynamo-snapshot/control"]},
            "agent.controlRoot and agent.hostBinds both mount /var/lib/dynamo-snapshot/control in the agent",
        ),
        (
            {**launch, "runtimeHostPaths": ["/srv/runc"], "writableBinds": ["/srv/runc"]},
            "agent.runtimeHostPaths and agent.writableBinds both mount /srv/runc in the agent",
        ),
        (
            {"launchWorkloads": True},
            "agent.launchWorkloads starts workers without a kubelet: set agent.runtime to runc or local",
        ),
        (
            {"stateRoot": "/var/lib/dynamo-snapshot/control/"},
            "agent.controlRoot and agent.stateRoot both mount /var/lib/dynamo-snapshot/control in the agent",
        ),
    ]
    for agent, message in cases:
        proc = template({"agent": agent})
        assert proc.returncode != 0, f"{agent} was accepted"
        assert message in proc.stderr, proc.stderr


def test_minimal_values_leave_out_rbac_policy_profile_metrics_and_webhook() -> None:
    objs = render(MINIMAL)
    assert kinds(objs) == ["ConfigMap", "ConfigMap", "CustomResourceDefinition", "DaemonSet", "Deployment"]
    ds = one(objs, "DaemonSet")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "own-agent"
    assert "initContainers" not in ds["spec"]["template"]["spec"]
    assert [p["name"] for p in _container(ds, "agent")["ports"]] == ["health"]
    deploy = one(objs, "Deployment", "-controller")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "own-controller"
    assert [p["name"] for p in _container(deploy, "controller")["ports"]] == ["health"]


def test_schema_rejects_bad_values_with_a_clear_message() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"agent": {"runtime": "docker"}},
            "at '/agent/runtime': value must be one of 'containerd', 'runc', 'local'",
        ),
        (
            {"agent": {"weightsCheckIdleIo": "yes"}},
            "at '/agent/weightsCheckIdleIo': got string, want boolean",
        ),
        ({"controler": {"replicas": 2}}, "additional properties 'controler' not allowed"),
        ({"controller": {"workers": "eight"}}, "at '/controller/workers': got string, want integer"),
        ({"controller": {"healthPort": 0}}, "at '/controller/healthPort'"),
        ({"agent": {"seccompProfile": {"errno": "EPERM"}}}, "at '/agent/seccompProfile/errno'"),
        ({"artifacts": {"persistence": {"sizee": "1Ti"}}}, "additional properties 'sizee' not allowed"),
        ({"agent": {"hostBinds": ["models"]}}, "at '/agent/hostBinds/0': 'models' does not match pattern"),
        ({"agent": {"writableBinds": ["/srv/x/"]}}, "at '/agent/writableBinds/0': '/srv/x/' does not match"),
        ({"agent": {"hostBinds": ["/srv/../etc"]}}, "at '/agent/hostBinds/0': '/srv/../etc' does not match"),
        ({"agent": {"hostBinds": ["//srv"]}}, "at '/agent/hostBinds/0': '//srv' does not match"),
        ({"agent": {"hostBinds": ["/"]}}, "at '/agent/hostBinds/0': '/' does not match"),
        ({"agent": {"writableBinds": ["/a", "/a"]}}, "at '/agent/writableBinds': items at 0 and 1 are equal"),
        ({"agent": {"cache": {"maxSize": "200GB"}}}, "at '/agent/cache/maxSize': '200GB' does not match"),
        ({"agent": {"cache": {"hostPath": "cache"}}}, "at '/agent/cache/hostPath': 'cache' does not match"),
    ]
    for values, message in cases:
        proc = template(values)
        assert proc.returncode != 0, f"{values} was accepted"
        assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
        assert message in proc.stderr, proc.stderr


def test_string_values_that_look_like_numbers_stay_strings() -> None:
    """PyYAML writes 86373e69 and 0x1f unquoted; helm reads them as numbers and its schema refuses them.
    The values file the tests and the demo write keeps them strings."""
    selector = {"pool": "86373e69", "hex": "0x1f", "octal": "0o17", "word": "true"}
    ds = one(render({"agent": {"nodeSelector": selector}}), "DaemonSet", "-agent")
    rendered = ds["spec"]["template"]["spec"]["nodeSelector"]
    assert {k: rendered[k] for k in selector} == selector


# --------------------------------------------------------------------------- RBAC, rendered


def test_controller_rbac_is_exactly_what_the_code_calls() -> None:
    """The calls in dynamo_snapshot/controller, kube and autoscale, verb for verb."""
    objs = render()
    assert rule_triples(one(objs, "ClusterRole", "-controller")) == rbac.CONTROLLER
    assert (
        rule_triples(one(objs, "ClusterRole", "-controller-cluster-scoped")) == rbac.CONTROLLER_CLUSTER_SCOPED
    )
    lease = one(objs, "Role", "-leader-election")
    assert lease["metadata"]["namespace"] == "ns1"
    assert rule_triples(lease) == rbac.LEADER_ELECTION


def test_controller_rbac_follows_autoscale_and_watch_namespace() -> None:
    objs = render(WATCH_ONE)
    rules = rule_triples(one(objs, "ClusterRole", "-controller"))
    assert not {r for r in rules if r[1].startswith("dynamoscalingpolicies")}
    assert ("nvidia.com", "dynamographdeployments", "*", "patch") not in rules
    binding = one(objs, "RoleBinding", "-controller")
    assert binding["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"]["name"].endswith("-controller")
    cluster_bindings = [o["roleRef"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert sorted(cluster_bindings) == [
        "t-dynamo-snapshot-agent",
        "t-dynamo-snapshot-controller-cluster-scoped",
    ]
    assert _config(objs, "controller")["namespace"] == "team-a"


def test_agent_rbac_is_exactly_what_the_code_calls() -> None:
    objs = render()
    assert rule_triples(one(objs, "ClusterRole", "-agent")) == rbac.AGENT


def test_admission_policy_allows_every_annotation_the_agent_writes() -> None:
    """The policy's prefixes must cover each annotation key the agent's code writes, or its reports would
    be refused in a real cluster."""
    prefixes = yaml.safe_load((CHART / "values.yaml").read_text())["agent"]["admissionPolicy"][
        "annotationPrefixes"
    ]
    agent_dir = Path(watcher.__file__).parent
    # authorize.py only reads what a pod asks for (nvidia.com/restore-from among it); it writes nothing.
    # ANNOTATION_CONTENT_* go on PodSnapshotContents, which the policy (pods only) does not cover.
    used = {
        name
        for path in agent_dir.rglob("*.py")
        if path.name != "authorize.py"
        for name in re.findall(r"protocol\.(ANNOTATION_[A-Z_]+)", path.read_text())
        if not name.startswith("ANNOTATION_CONTENT_")
    }
    assert used, "found no annotations in the agent's code: the scan is broken"
    for name in sorted(used):
        key = getattr(protocol, name)
        assert any(key.startswith(p) for p in prefixes), f"{name}={key!r} is outside {prefixes}"

    policy = one(render(release="r", namespace="snap"), "ValidatingAdmissionPolicy")
    (condition,) = policy["spec"]["matchConditions"]
    assert (
        condition["expression"]
        == 'request.userInfo.username == "system:serviceaccount:snap:r-dynamo-snapshot-agent"'
    )
