"""The DGD CRD template's conversion webhook: v1beta1 is stored and always served; with webhook.enabled
v1alpha1 is served too, converted by this release's webhook Service, trusted through the CA the restore
webhook's certificate is signed by (or the given caBundle with webhook.certs.existingSecret); without the
webhook the CRD is the generated one, v1beta1 alone served."""

from __future__ import annotations

import base64

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
from tests.helm.chart import WEBHOOK_OFF, Obj, one, render


def _crd(objs: list[Obj]) -> Obj:
    return one(objs, "CustomResourceDefinition")


def test_with_the_webhook_v1alpha1_is_served_and_converted_by_the_release_service() -> None:
    objs = render(release="rel", namespace="snap")
    crd = _crd(objs)
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [
        ("v1alpha1", True, False),
        ("v1beta1", True, True),
    ]
    conversion = crd["spec"]["conversion"]
    ca = conversion["webhook"]["clientConfig"].pop("caBundle")
    service = one(objs, "Service", "-controller-webhook")["metadata"]
    assert conversion == {
        "strategy": "Webhook",
        "webhook": {
            "conversionReviewVersions": ["v1"],
            "clientConfig": {
                "service": {
                    "namespace": "snap",
                    "name": service["name"],
                    "path": crdgen.CONVERSION_PATH,
                    "port": 443,
                }
            },
        },
    }
    assert service["namespace"] == "snap"
    # One CA per render: what the restore webhook and the Secret's certificate trust.
    assert ca == one(objs, "Secret", "-webhook-tls")["data"]["ca.crt"]
    [hook] = one(objs, "MutatingWebhookConfiguration")["webhooks"]
    assert ca == hook["clientConfig"]["caBundle"]
    assert base64.b64decode(ca).startswith(b"-----BEGIN CERTIFICATE-----")
    # The versions' schemas are the generated ones.
    generated = crdgen.generated_crd(DynamoGraphDeployment)["spec"]["versions"]
    assert [v["schema"] for v in crd["spec"]["versions"]] == [v["schema"] for v in generated]


def test_an_existing_secret_brings_its_ca_bundle() -> None:
    values = {"webhook": {"certs": {"existingSecret": "mine", "caBundle": "Q0EK"}}}
    objs = render(values)
    assert _crd(objs)["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"] == "Q0EK"
    assert not [o for o in objs if o["kind"] == "Secret" and "webhook" in o["metadata"]["name"]]


def test_without_the_webhook_the_crd_is_the_generated_one_serving_v1beta1_alone() -> None:
    crd = _crd(render(WEBHOOK_OFF))
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [
        ("v1alpha1", False, False),
        ("v1beta1", True, True),
    ]
    assert crd["spec"] == crdgen.generated_crd(DynamoGraphDeployment)["spec"]


def test_the_generated_file_serves_only_the_storage_version() -> None:
    """kubectl apply -f crds/ serves v1beta1 alone, the version stored: nothing needs converting, and its
    placeholder Service is never called."""
    crd = crdgen.generated_crd(DynamoGraphDeployment)
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [
        ("v1alpha1", False, False),
        ("v1beta1", True, True),
    ]
    assert crd["spec"]["conversion"]["webhook"]["clientConfig"] == {
        "service": dict(crdgen.CONVERSION_SERVICE)
    }
