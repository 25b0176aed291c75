"""Fixtures for the API tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api.examples import MANIFEST_FILES, load_manifest


@pytest.fixture(params=MANIFEST_FILES, ids=[path.stem for path in MANIFEST_FILES])
def manifest(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each example manifest, as it is applied to the cluster."""
    path: Path = request.param
    return load_manifest(path)
