"""The house rules a reader relies on, checked over the whole code (the product's and SDK's `dynamo_snapshot`
and the dev harness's `dynamo_snapshot_dev`): no package imports another's private names, no module over
600 lines and no function over 80 without a reason written next to it; and, over every tracked file, no
reference to this project's issue numbers (the repository states what is true, not how it got there).

A reason is a comment `# long: <why>` on the line above the `def` (or the module's first lines, for a
module): the exception is visible where a reader meets it, not in a list here.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (ROOT / "dynamo_snapshot", ROOT / "dynamo_snapshot_dev")
MODULE_MAX_LINES = 600
FUNCTION_MAX_LINES = 80
REASON = "# long:"


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in package.rglob("*.py"))


def _package_of(module: str) -> str:
    # dynamo_snapshot[_dev].<package>...: the unit whose private names are its own business.
    return ".".join(module.split(".")[:2])


def _dotted(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
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
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                ("dynamo_snapshot.", "dynamo_snapshot_dev.")
            ):
                continue
            if _package_of(node.module or "") == own:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            private += [part for part in (node.module or "").split(".") if part.startswith("_")]
            if private:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}: {private}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)


def test_modules_and_functions_stay_small_or_say_why() -> None:
    found = []
    for path in _modules():
        text = path.read_text()
        lines = text.splitlines()
        rel = path.relative_to(ROOT)
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


# "issue" or "issues", a space and a number, or a heading's anchor ending in "-issue-<n>"; an upstream
# project's issue is named by its URL (https://github.com/<owner>/<repo>/issues/<n>), which this does not
# match. (The examples below are spelled in two pieces, so this file passes its own rule.)
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? [0-9]+|[Ii]ssues?-[0-9]+")
# Recorded output of the benchmarks: data as it was written, not prose of this repository.
ISSUE_RULE_EXEMPT = ("benchmarks/results/",)


def _issue_references(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE_NUMBER.finditer(text)]


def test_no_file_refers_to_this_projects_issue_numbers() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    found = []
    for name in tracked:
        path = ROOT / name
        if name.startswith(ISSUE_RULE_EXEMPT) or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # images and other binary files
        for lineno, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{lineno}: {ref}" for ref in _issue_references(line)]
    assert not found, "issue numbers (say what is true now, or link the upstream issue):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("## Controller at scale (issue" + " 4)", ["issue" + " 4"]),
        ("## Restore (issues" + " 6 and 21)", ["issues" + " 6"]),
        ("[x](#failover-by-restore-issue" + "-8)", ["issue" + "-8"]),
        ("# (https://github.com/NVIDIA/cuda-checkpoint/issues/41)", []),
        ("criu issue #2131; upstream #2705", []),
        ("a tissue 5 cm wide", []),
    ],
)
def test_what_counts_as_an_issue_number(line: str, expected: list[str]) -> None:
    assert _issue_references(line) == expected
