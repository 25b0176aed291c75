"""Applying manifests with kubectl against the local cluster, for the CRD validation tests."""

from __future__ import annotations

import json
from typing import Any

from dynamo_snapshot.localcluster import LocalCluster


def apply(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def refused(cluster: LocalCluster, namespace: str, manifest: dict[str, Any]) -> str:
    """Apply ``manifest``, expecting the apiserver to refuse it; returns kubectl's error output."""
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0, f"the apiserver accepted {json.dumps(manifest)}:\n{proc.stdout}"
    return proc.stderr
