"""The chart's restore webhook (webhook.enabled): the MutatingWebhookConfiguration, its Service and TLS
Secret, and the controller Deployment that serves it, rendered by the real helm; the generated certificate
checked with openssl; the controller's own settings model reading the flags the Deployment passes; and,
against the real apiserver, a server-side dry run of everything and the certificate kept across upgrades
(lookup). The webhook itself, called by the apiserver, is tested in
tests/integration/test_restore_webhook.py."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot.cli.controller_cmd import ControllerCommandConfig, load_config
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.controller.webhook_server import CERT_FILE, KEY_FILE, MUTATE_PATH
from dynamo_snapshot.localcluster import LocalCluster
from tests.helm.chart import CHART, Obj, helm, kinds, lint, one, render, render_text, template

ON = {"webhook": {"enabled": True}}
EXPRESSION = (
    f"has(object.metadata.annotations) && '{protocol.ANNOTATION_RESTORE_FROM}' in object.metadata.annotations"
)


def _controller(objs: list[Obj]) -> tuple[Obj, Obj]:
    """The controller Deployment's pod spec and its container."""
    pod = one(objs, "Deployment", "-controller")["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == "controller")


def _hook(objs: list[Obj]) -> Obj:
    hooks = one(objs, "MutatingWebhookConfiguration")["webhooks"]
    assert len(hooks) == 1
    hook: Obj = hooks[0]
    return hook


def _settings(container: Obj, tmp_path: Path) -> ControllerCommandConfig:
    """What the controller process makes of the Deployment's command line (its config file: empty)."""
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    argv = [*container["command"][1:], *container["args"]]
    argv[argv.index("--config") + 1] = str(config)
    return load_config(build_parser().parse_args(argv))


def test_off_by_default_and_no_trace_of_it() -> None:
    objs = render()
    assert "MutatingWebhookConfiguration" not in kinds(objs)
    assert not [o for o in objs if "webhook" in o["metadata"]["name"]]
    _, c = _controller(objs)
    assert "webhook" not in {p["name"] for p in c["ports"]}
    assert not [a for a in c["args"] if "webhook" in str(a)]


@pytest.mark.parametrize(
    "values",
    [ON, {"webhook": {"enabled": True}, "controller": {"watchNamespace": "team-a", "autoscale": False}}],
    ids=["on", "on-one-namespace"],
)
def test_lint_is_clean(values: Obj) -> None:
    proc = lint(values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout, proc.stdout


def test_the_configuration_sends_only_restore_from_pods_and_refuses_them_while_unanswered(
    tmp_path: Path,
) -> None:
    objs = render(ON, release="rel", namespace="snap-system")
    assert sorted(set(kinds(objs)) - set(kinds(render()))) == ["MutatingWebhookConfiguration", "Secret"]
    hook = _hook(objs)
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert hook["matchConditions"] == [{"name": "restore-from-annotated", "expression": EXPRESSION}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == ("Fail", "None", 10)
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert "namespaceSelector" not in hook

    # The Service reaches the port the controller serves, on the path it serves.
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == MUTATE_PATH
    service = one(objs, "Service", "-controller-webhook")
    assert (ref["name"], ref["namespace"]) == (service["metadata"]["name"], "snap-system")
    assert [p["port"] for p in service["spec"]["ports"]] == [ref["port"]] == [443]
    pod, c = _controller(objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["webhook"] == 9443
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    deploy_labels = one(objs, "Deployment", "-controller")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= deploy_labels.items()

    # The process listens there, with the certificate of the Secret, mounted whole (rotations reach it).
    settings = _settings(c, tmp_path)
    assert settings.webhook_port == 9443
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == settings.webhook_cert_dir)
    assert "subPath" not in mount
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = one(objs, "Secret", "-webhook-tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert {i["path"] for i in volume["secret"]["items"]} == {CERT_FILE, KEY_FILE}
    assert secret["type"] == "kubernetes.io/tls"


def _openssl(*args: str, stdin: bytes | None = None) -> str:
    proc = subprocess.run(["openssl", *args], input=stdin, capture_output=True, check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_the_generated_certificate_is_for_the_service_and_signed_by_the_ca_bundle(tmp_path: Path) -> None:
    objs = render(ON, release="rel", namespace="snap-system")
    data = {k: base64.b64decode(v) for k, v in one(objs, "Secret", "-webhook-tls")["data"].items()}
    assert base64.b64decode(_hook(objs)["clientConfig"]["caBundle"]) == data["ca.crt"]
    (tmp_path / "ca.crt").write_bytes(data["ca.crt"])
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    assert "tls.crt: OK" in _openssl("verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt"))
    text = _openssl("x509", "-noout", "-text", stdin=data["tls.crt"])
    host = "rel-dynamo-snapshot-controller-webhook.snap-system.svc"
    assert f"DNS:{host}" in text
    assert "DNS:rel-dynamo-snapshot-controller-webhook.snap-system," in text + ","
    # The key is the certificate's.
    assert _openssl("pkey", "-pubout", stdin=data["tls.key"]) == _openssl(
        "x509", "-noout", "-pubkey", stdin=data["tls.crt"]
    )


def test_an_existing_secret_and_ca_bundle_are_used_as_given() -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n...\n").decode()
    values = {"webhook": {"enabled": True, "certs": {"existingSecret": "from-cert-manager", "caBundle": ca}}}
    objs = render(values)
    assert "Secret" not in kinds(objs)
    assert _hook(objs)["clientConfig"]["caBundle"] == ca
    pod, _ = _controller(objs)
    assert next(v for v in pod["volumes"] if v["name"] == "webhook-certs")["secret"]["secretName"] == (
        "from-cert-manager"
    )
    proc = template({"webhook": {"enabled": True, "certs": {"existingSecret": "from-cert-manager"}}})
    assert proc.returncode != 0
    assert "webhook.certs.caBundle" in proc.stderr
    assert "is required with webhook.certs.existingSecret" in proc.stderr


def test_values_reach_the_configuration_and_one_watched_namespace_limits_it() -> None:
    values = {
        "webhook": {"enabled": True, "failurePolicy": "Ignore", "timeoutSeconds": 5, "port": 10443},
        "controller": {"watchNamespace": "team-a", "autoscale": False},
    }
    objs = render(values)
    hook = _hook(objs)
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Ignore", 5)
    assert hook["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    _, c = _controller(objs)
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["webhook"] == 10443
    assert c["args"][c["args"].index("--webhook-port") + 1] == "10443"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"webhook": {"failurePolicy": "Never"}},
            "at '/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'",
        ),
        ({"webhook": {"timeoutSeconds": 31}}, "at '/webhook/timeoutSeconds'"),
        ({"webhook": {"port": 0}}, "at '/webhook/port'"),
        ({"webhook": {"enable": True}}, "additional properties 'enable' not allowed"),
        ({"webhook": {"certs": {"secret": "x"}}}, "additional properties 'secret' not allowed"),
    ],
)
def test_the_schema_refuses_bad_webhook_values(values: Obj, message: str) -> None:
    proc = template(values)
    assert proc.returncode != 0, f"{values} was accepted"
    assert message in proc.stderr, proc.stderr


def test_the_process_refuses_one_port_for_the_webhook_and_another_server() -> None:
    with pytest.raises(ValueError, match="webhookPort and healthPort are both 8081"):
        ControllerCommandConfig.model_validate({"webhookPort": 8081})
    with pytest.raises(ValueError, match="webhookPort and metricsPort are both 8080"):
        ControllerCommandConfig.model_validate({"webhookPort": 8080})


# --------------------------------------------------------------------------- against the real apiserver


@pytest.mark.cluster
def test_rendered_webhook_manifests_pass_server_side_dry_run(cluster: LocalCluster, namespace: str) -> None:
    text = render_text(ON, release=f"w{namespace[-6:]}", namespace=namespace)
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=text)
    count = len([d for d in yaml.safe_load_all(text) if d])
    assert out.stdout.count("serverside-applied (server dry run)") == count, out.stdout
    assert "mutatingwebhookconfiguration.admissionregistration.k8s.io" in out.stdout


def _render_against(cluster: LocalCluster, release: str, namespace: str) -> list[Obj]:
    """`helm template --dry-run=server`: rendered with `lookup` reading the cluster, as an upgrade is."""
    proc = helm(
        "template", release, str(CHART), "--namespace", namespace, "--set", "webhook.enabled=true",
        "--dry-run=server", "--kubeconfig", str(cluster.kubeconfig),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.cluster
def test_an_installed_certificate_is_kept_across_upgrades(cluster: LocalCluster, namespace: str) -> None:
    release = f"w{namespace[-6:]}"
    first = _render_against(cluster, release, namespace)
    secret = one(first, "Secret", "-webhook-tls")
    # Installed: the next render (an upgrade) finds it and keeps the CA the apiserver already trusts.
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(secret))
    again = _render_against(cluster, release, namespace)
    assert one(again, "Secret", "-webhook-tls")["data"] == secret["data"]
    assert _hook(again)["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # Without the Secret, a render makes a new CA: the reuse above is the lookup's doing.
    fresh = _render_against(cluster, f"x{namespace[-6:]}", namespace)
    assert one(fresh, "Secret", "-webhook-tls")["data"]["ca.crt"] != secret["data"]["ca.crt"]
