"""Fixtures for the autoscaler's Prometheus tests: fake vLLM exporters and a real Prometheus scraping them.

One Prometheus and two exporters (two "pods") serve the whole module; each test starts from exporters
that expose nothing.  Prometheus scrapes every second, so a value set now is queryable within ~1-2 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamo_snapshot_dev.localcluster import LocalPrometheus
from tests.autoscale.exporter import FakeVllmExporter
from tests.helpers.prometheus import local_prometheus


@pytest.fixture(scope="module")
def exporters() -> Iterator[list[FakeVllmExporter]]:
    """Two exporters, one pod each (worker-0, worker-1)."""
    made = [FakeVllmExporter(["worker-0"]), FakeVllmExporter(["worker-1"])]
    yield made
    for exporter in made:
        exporter.stop()


@pytest.fixture(scope="module")
def prometheus(
    exporters: list[FakeVllmExporter], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    targets = [exporter.address for exporter in exporters]
    with local_prometheus(targets, tmp_path_factory.mktemp("prometheus")) as server:
        yield server


@pytest.fixture
def fresh_exporters(exporters: list[FakeVllmExporter]) -> list[FakeVllmExporter]:
    """The module's exporters, exposing no samples at the start of the test."""
    for exporter in exporters:
        exporter.clear()
    return exporters
