"""dynamo_snapshot.api is the lowest layer: stdlib, pydantic and yaml only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import dynamo_snapshot.api

ALLOWED_THIRD_PARTY = {"pydantic", "yaml"}
API_DIR = Path(dynamo_snapshot.api.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_api_imports_only_stdlib_pydantic_yaml_and_itself() -> None:
    offenders = []
    for path in sorted(API_DIR.glob("*.py")):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if module == "dynamo_snapshot.api" or module.startswith("dynamo_snapshot.api."):
                continue
            if top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
                continue
            offenders.append(f"{path.name}: {module}")
    assert offenders == []
