"""The chart's restore webhook (webhook.enabled, on by default): the MutatingWebhookConfiguration, its
Service and TLS Secret, and the controller Deployment that serves it, rendered by the real helm, and no
trace of any of it when disabled; the NOTES that explain it; the generated certificate
checked with openssl; the controller's own settings model reading the flags the Deployment passes; and,
against the real apiserver, a server-side dry run of everything and the certificate kept across upgrades
(lookup). The webhook itself, called by the apiserver, is tested in
tests/integration/test_restore_webhook.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot.cli.controller_cmd import ControllerCommandConfig, load_config
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.controller.webhook_server import CERT_FILE, KEY_FILE, MUTATE_PATH
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helm.chart import (
    CHART,
    WEBHOOK_OFF,
    Obj,
    helm,
    kinds,
    lint,
    one,
    render,
    render_text,
    template,
)

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


def _ids(objs: list[Obj]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def test_on_by_default_and_off_when_disabled_with_no_trace_of_it() -> None:
    on = render()
    off = render(WEBHOOK_OFF)
    # Disabling removes the webhook's three objects and nothing else.
    assert _ids(on) - _ids(off) == {
        ("MutatingWebhookConfiguration", "t-dynamo-snapshot-restore"),
        ("Service", "t-dynamo-snapshot-controller-webhook"),
        ("Secret", "t-dynamo-snapshot-controller-webhook-tls"),
    }
    assert _ids(off) <= _ids(on)
    assert "MutatingWebhookConfiguration" not in kinds(off)
    assert not [o for o in off if "webhook" in o["metadata"]["name"]]
    pod, c = _controller(off)
    assert "webhook" not in {p["name"] for p in c["ports"]}
    assert not [a for a in c["args"] if "webhook" in str(a)]
    assert not [m for m in c["volumeMounts"] if "webhook" in m["mountPath"] + m["name"]]
    assert not [v for v in pod["volumes"] if "webhook" in v["name"]]
    # The controller differs by the webhook alone.
    on_pod, on_c = _controller(on)
    assert [p for p in on_c["ports"] if p["name"] != "webhook"] == c["ports"]
    assert [v for v in on_pod["volumes"] if v["name"] != "webhook-certs"] == pod["volumes"]


@pytest.mark.parametrize(
    "values",
    [WEBHOOK_OFF, {"controller": {"watchNamespace": "team-a", "autoscale": False}}],
    ids=["off", "on-one-namespace"],
)
def test_lint_is_clean(values: Obj) -> None:
    proc = lint(values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout, proc.stdout


def test_the_configuration_sends_only_restore_from_pods_and_refuses_them_while_unanswered(
    tmp_path: Path,
) -> None:
    objs = render(release="rel", namespace="snap-system")
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
    objs = render(release="rel", namespace="snap-system")
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
    text = render_text(release=f"w{namespace[-6:]}", namespace=namespace)
    # Forced, as in test_chart_cluster: the session's DGD CRD may carry another manager's fields.
    out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-", input=text
    )
    count = len([d for d in yaml.safe_load_all(text) if d])
    assert out.stdout.count("serverside-applied (server dry run)") == count, out.stdout
    assert "mutatingwebhookconfiguration.admissionregistration.k8s.io" in out.stdout


def _notes(cluster: LocalCluster, *sets: str) -> str:
    """The NOTES of an install (client dry run: helm still asks the apiserver its version), one line."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    args = ["install", "notes", str(CHART), "--namespace", "snap", "--dry-run=client"]
    proc = helm(*args, *[a for s in sets for a in ("--set", s)], env=env)
    assert proc.returncode == 0, proc.stderr
    _, _, notes = proc.stdout.partition("\nNOTES:\n")
    assert notes, proc.stdout
    return " ".join(notes.split())


@pytest.mark.cluster
def test_notes_explain_the_webhook_and_the_agents_restored_condition(
    cluster: LocalCluster, without_dgd_crd: None
) -> None:
    objs = render(release="notes", namespace="snap")
    hook, service = one(objs, "MutatingWebhookConfiguration"), one(objs, "Service", "-controller-webhook")
    notes = _notes(cluster)
    assert f"pod created with the annotation {protocol.ANNOTATION_RESTORE_FROM}:" in notes
    assert (
        f"MutatingWebhookConfiguration {hook['metadata']['name']} sends it to Service "
        f"{service['metadata']['name']} (port 443, the controller's port 9443"
    ) in notes
    assert "for pods of namespace" not in notes
    assert "other pods never go to the webhook" in notes
    assert "failurePolicy Fail: while no controller replica answers, such pods are refused" in notes
    # The agent's policy: its annotations, and through pods/status that one condition with its reasons.
    policy = one(objs, "ValidatingAdmissionPolicy")
    assert f"ValidatingAdmissionPolicy {policy['metadata']['name']} does" in notes
    assert f"through pods/status, exactly the pod condition {protocol.POD_CONDITION_RESTORED} (" in notes
    reasons = next(v for v in policy["spec"]["variables"] if v["name"] == "restoredReasons")["expression"]
    for reason in protocol.RestoredReason:
        assert reason.value in notes, reason
        assert f"'{reason.value}'" in reasons, reason

    narrowed = _notes(cluster, "webhook.failurePolicy=Ignore", "controller.watchNamespace=team-a")
    assert "for pods of namespace team-a only" in narrowed
    ignored = "failurePolicy Ignore: while no controller replica answers, such pods are admitted unshaped"
    assert ignored in narrowed
    off = _notes(cluster, "webhook.enabled=false", "agent.admissionPolicy.enabled=false")
    assert "MutatingWebhookConfiguration" not in off
    shaped = f"pods created with {protocol.ANNOTATION_RESTORE_FROM} are not shaped"
    assert f"webhook.enabled is false: {shaped}" in off
    assert f"or to the {protocol.POD_CONDITION_RESTORED} condition" in off


def _render_against(cluster: LocalCluster, release: str, namespace: str) -> list[Obj]:
    """`helm template --dry-run=server`: rendered with `lookup` reading the cluster, as an upgrade is."""
    proc = helm(
        "template", release, str(CHART), "--namespace", namespace,
        "--dry-run=server", "--kubeconfig", str(cluster.kubeconfig),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.cluster
def test_an_installed_certificate_is_kept_across_upgrades(
    cluster: LocalCluster, namespace: str, without_dgd_crd: None
) -> None:
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
