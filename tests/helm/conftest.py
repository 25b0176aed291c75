"""Fixtures of the chart's tests against the real apiserver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers import dgd_crd


@pytest.fixture
def without_dgd_crd(cluster: LocalCluster) -> Iterator[None]:
    """A cluster as a first install finds it: no DynamoGraphDeployment CRD, which the session's CRDs (applied
    by kubectl, in no release) would otherwise be. With one there, Helm refuses a standalone install: the
    chart's lookup (helm template --dry-run=server) or Helm's own ownership check (--dry-run=client)."""
    with dgd_crd.dgd_crd_as(cluster, None):
        yield
