"""The example manifests in manifests/, for the API tests and the apiserver integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MANIFEST_DIR = Path(__file__).resolve().parent / "manifests"
MANIFEST_FILES = sorted(MANIFEST_DIR.glob("*.yaml"))


def load_manifest(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), f"{path} is not a single YAML mapping"
    return document
