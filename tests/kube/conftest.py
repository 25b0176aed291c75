"""Fixtures for the controller-runtime integration tests; the control plane is tests/conftest.py's."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from dynamo_snapshot.kube.kube import Kube, ResourceKind
from dynamo_snapshot_dev.localcluster import LocalCluster

GADGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.runtime-test.dynamo-snapshot.dev"},
    "spec": {
        "group": "runtime-test.dynamo-snapshot.dev",
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}
GADGET = ResourceKind.custom("runtime-test.dynamo-snapshot.dev", "v1", "Gadget")


@pytest.fixture(scope="session")
def gadgets(cluster: LocalCluster) -> ResourceKind:
    """A namespaced CRD with a status subresource.  Its watch cache starts when the CRD is installed,
    long after resourceVersion 1, so a watch from "1" gets a real 410 Expired from the apiserver."""
    cluster.apply(GADGET_CRD)
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", f"crd/{GADGET_CRD['metadata']['name']}"
    )
    return GADGET


@pytest.fixture
def kube(api: client.ApiClient) -> Kube:
    return Kube(api, field_manager="dynsnap-runtime-test")
