"""A real Prometheus (the one scripts/test-env.sh caches) scraping the given targets, for module fixtures."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster import LocalPrometheus, LocalPrometheusError
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError


@contextmanager
def local_prometheus(targets: Iterable[str], workdir: Path) -> Iterator[LocalPrometheus]:
    """Started, with every target up; stopped on the way out. A Prometheus that cannot start fails the
    test in one line (the fix is almost always scripts/test-env.sh)."""
    server = LocalPrometheus(list(targets), workdir=workdir)
    try:
        server.start()
        server.wait_targets_up()
    except (ComponentsMissingError, LocalPrometheusError) as e:
        server.stop()
        pytest.fail(f"local prometheus: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
