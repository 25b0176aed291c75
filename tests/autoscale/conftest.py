"""Fixtures for the autoscaler's Prometheus tests: fake vLLM exporters and a real Prometheus scraping them.

One Prometheus and two exporters (two "pods") serve the whole module; each test starts from exporters
that expose nothing.  Prometheus scrapes every second, so a value set now is queryable within ~1-2 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dynamo_snapshot.localcluster import LocalPrometheus, LocalPrometheusError
from dynamo_snapshot.localcluster.components import ComponentsMissingError
from tests.autoscale.exporter import FakeVllmExporter


def _fail(msg: str) -> None:
    pytest.fail(msg, pytrace=False)


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
    server = LocalPrometheus(
        [exporter.address for exporter in exporters], workdir=tmp_path_factory.mktemp("prometheus")
    )
    try:
        server.start()
        server.wait_targets_up()
    except (ComponentsMissingError, LocalPrometheusError) as e:
        server.stop()
        _fail(f"local prometheus: {e}")
    yield server
    server.stop()


@pytest.fixture
def fresh_exporters(exporters: list[FakeVllmExporter]) -> list[FakeVllmExporter]:
    """The module's exporters, exposing no samples at the start of the test."""
    for exporter in exporters:
        exporter.clear()
    return exporters
