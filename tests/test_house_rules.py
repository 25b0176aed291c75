"""The house rules a reader relies on, checked over the whole package: no package imports another's
private names, no module over 600 lines and no function over 80 without a reason written next to it.

A reason is a comment `# long: <why>` on the line above the `def` (or the module's first lines, for a
module): the exception is visible where a reader meets it, not in a list here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dynamo_snapshot"
MODULE_MAX_LINES = 600
FUNCTION_MAX_LINES = 80
REASON = "# long:"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _package_of(module: str) -> str:
    # dynamo_snapshot.<package>...: the unit whose private names are its own business.
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A `# long:` comment on one of the lines just above line `lineno` (1-based), decorators skipped."""
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("@"):
        i -= 1
    return i >= 0 and lines[i].lstrip().startswith(REASON)


def test_no_package_imports_another_packages_private_names() -> None:
    found = []
    for path in _modules():
        own = _package_of(_dotted(path))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("dynamo_snapshot."):
                continue
            if _package_of(node.module or "") == own:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            private += [part for part in (node.module or "").split(".") if part.startswith("_")]
            if private:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module}: {private}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def test_modules_and_functions_stay_small_or_say_why() -> None:
    found = []
    for path in _modules():
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(PACKAGE.parent)
        if len(lines) > MODULE_MAX_LINES and not any(line.startswith(REASON) for line in lines[:15]):
            found.append(f"{rel}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_MAX_LINES and not _has_reason(lines, node.lineno):
                    found.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not found, (
        f"over {MODULE_MAX_LINES} lines per module or {FUNCTION_MAX_LINES} per function, with no "
        f"`{REASON} <why>` comment:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("# long: a table\ndef f():\n    pass\n", True),
        ("# long: a table\n@decorator\ndef f():\n    pass\n", True),
        ("# why not\ndef f():\n    pass\n", False),
        ("def f():\n    pass\n", False),
    ],
)
def test_a_reason_is_found_only_right_above_the_def(source: str, expected: bool) -> None:
    lines = source.splitlines()
    lineno = next(i for i, line in enumerate(lines, 1) if line.startswith("def "))
    assert _has_reason(lines, lineno) is expected
