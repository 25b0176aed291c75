"""Applying manifests with kubectl against the local cluster, for the tests of what the apiserver refuses.

A plain apply stores what it is given (``LocalCluster.apply``); ``server_dry_run`` asks the apiserver what
it would store, storing nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.api.helpers import MODELS

# A server-side apply the apiserver validates, defaults and answers with, storing nothing.
SERVER_DRY_RUN = ("--server-side", "--dry-run=server", "-o", "json")


def _apply(
    cluster: LocalCluster, namespace: str, manifest: dict[str, Any] | Path, *flags: str, check: bool
) -> subprocess.CompletedProcess[str]:
    if isinstance(manifest, Path):
        return cluster.kubectl("apply", *flags, "-n", namespace, "-f", str(manifest), check=check)
    return cluster.kubectl(
        "apply", *flags, "-n", namespace, "-f", "-", input=json.dumps(manifest), check=check
    )


def server_dry_run(
    cluster: LocalCluster, namespace: str, manifest: dict[str, Any] | Path, *, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Server-side apply of ``manifest`` (or of a file) with --dry-run=server: on success its stdout is
    what the apiserver would store, as JSON (a List for a file of several)."""
    return _apply(cluster, namespace, manifest, *SERVER_DRY_RUN, check=check)


def refused(cluster: LocalCluster, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False) -> str:
    """Apply ``manifest`` (with ``dry_run``, as ``server_dry_run`` does), expecting the apiserver to refuse
    it; returns kubectl's error output."""
    proc = _apply(cluster, namespace, manifest, *(SERVER_DRY_RUN if dry_run else ()), check=False)
    assert proc.returncode != 0, f"the apiserver accepted {json.dumps(manifest)}:\n{proc.stdout}"
    return proc.stderr


def refused_by_both(
    cluster: LocalCluster,
    namespace: str,
    manifest: dict[str, Any],
    match: str | None = None,
    *,
    dry_run: bool = False,
) -> str:
    """The model of its kind refuses ``manifest`` (with ``match`` in the error) and so does the apiserver;
    returns the apiserver's error, as ``refused``."""
    with pytest.raises(ValidationError, match=match):
        MODELS[manifest["kind"]].model_validate(manifest)
    return refused(cluster, namespace, manifest, dry_run=dry_run)
