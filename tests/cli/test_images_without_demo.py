"""The controller and agent images hold production code only, and the command line works in them.

No Docker daemon here: the build context each image gets is computed from its Dockerfile's ignore file
with Docker's matching rules, and the image's Python is stood in for by a subprocess whose imports of the
demo-only modules fail as they would where those files are absent.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

from dynamo_snapshot.cli.demo_absent import DEMO_MODULES, NOT_INSTALLED

REPO = Path(__file__).resolve().parents[2]
IMAGES = ("controller", "agent")
DEMO_PATHS = ("dynamo_snapshot/localcluster", "dynamo_snapshot/cli/demo", "dynamo_snapshot/cli/demo_cmd.py")


def _demo_only(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in DEMO_PATHS)


# --------------------------------------------------------------------------- the build context


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's ignore-file pattern (moby/patternmatcher): `**` any number of directories, `*` and `?`
    within one path element."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + "$")


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, regex in rules:
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


@cache
def _repo_files() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(f for f in out.splitlines() if (REPO / f).is_file())


def build_context(image: str) -> set[str]:
    """The files `docker build -f <image>/Dockerfile .` sends from the repository root."""
    rules = []
    for raw in (REPO / image / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((negated, _pattern_regex(pattern)))
    return {f for f in _repo_files() if not _ignored(f, rules)}


def test_the_pattern_rules_match_dockers() -> None:
    rules = [(False, _pattern_regex("*")), (True, _pattern_regex("src")), (False, _pattern_regex("**/x"))]
    assert _ignored("README.md", rules)
    assert not _ignored("src/a/b.py", rules)
    assert _ignored("src/x", rules)
    assert _ignored("src/a/x/c.py", rules), "a parent directory that matches decides for what is in it"


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_context_holds_production_code_and_no_demo(image: str) -> None:
    context = build_context(image)
    leaked = sorted(f for f in context if _demo_only(f))
    assert not leaked, f"{image} image gets demo-only files: {leaked[:5]}"
    assert not [f for f in context if "__pycache__" in f]
    # What the Dockerfile copies is there, with every production module.
    dockerfile = (REPO / image / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert any(f == source or f.startswith(source + "/") for f in context), (image, source)
    production = {
        f
        for f in _repo_files()
        if f.startswith("dynamo_snapshot/") and not _demo_only(f) and "__pycache__" not in f
    }
    assert production <= context, sorted(production - context)[:5]
    assert "dynamo_snapshot/cli/main.py" in context


def _is_demo(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in DEMO_MODULES)


def test_no_production_module_imports_the_demo_except_where_it_may_be_absent() -> None:
    """Only `cli/main.py` reaches for the demo, and it stands in a `demo` that says it is not installed
    when the import fails; the demo's own modules may import each other."""
    found = []
    for path in sorted((REPO / "dynamo_snapshot").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if _demo_only(rel) or rel == "dynamo_snapshot/cli/main.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"{rel}:{node.lineno} {n}" for n in names if _is_demo(n)]
    assert not found, found


# --------------------------------------------------------------------------- the command line without them

_BLOCKER = '''
import importlib.abc
import os
import sys


class _Absent(importlib.abc.MetaPathFinder):
    """These modules are not installed: their import fails as a missing file's would."""

    blocked = os.environ["DSNAP_ABSENT_MODULES"].split(",")

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in self.blocked):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''

# The image leaves out all three; a checkout whose demo package is broken or partial has the command only.
ABSENT = {
    "image": DEMO_MODULES,
    "demo command without the demo": ("dynamo_snapshot.cli.demo", "dynamo_snapshot.localcluster"),
}


# Runs each command line through `main` in one process (an interpreter start per command costs seconds on
# a loaded machine) and prints, per line, its exit code, stdout and stderr as JSON.
_DRIVER = """
import contextlib, io, json, sys
from dynamo_snapshot.cli.main import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, out.getvalue(), err.getvalue()]))
"""


def _python(tmp_path: Path, absent: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(_BLOCKER))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "DSNAP_ABSENT_MODULES": ",".join(absent),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def _cli_runs(tmp_path: Path, absent: tuple[str, ...], runs: list[list[str]]) -> list[tuple[int, str, str]]:
    proc = _python(tmp_path, absent, "-c", _DRIVER, json.dumps(runs))
    assert proc.returncode == 0, proc.stderr
    return [tuple(json.loads(line)) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("absent", ABSENT.values(), ids=ABSENT.keys())
def test_commands_work_without_the_demo_and_demo_says_so(tmp_path: Path, absent: tuple[str, ...]) -> None:
    commands = ("controller", "agent", "crds", "identity")
    demo_runs = [["demo"], ["demo", "--quick", "--keep"]]
    if "dynamo_snapshot.cli.demo_cmd" in absent:
        demo_runs.append(["demo", "--help"])  # no flags to describe: it says it is not there
    runs = [["--help"], *([c, "--help"] for c in commands), ["crds"], *demo_runs]
    results = dict(zip(map(tuple, runs), _cli_runs(tmp_path, absent, runs), strict=True))

    code, out, err = results[("--help",)]
    assert code == 0, err
    for command in (*commands, "checkpoint", "demo"):
        assert command in out
    for command in commands:
        code, out, err = results[(command, "--help")]
        assert (code, err) == (0, ""), command
        assert f"dynamo-snapshot {command}" in out
    code, out, err = results[("crds",)]
    assert code == 0, err
    assert "CustomResourceDefinition" in out
    for argv in demo_runs:
        code, out, err = results[tuple(argv)]
        assert (code, out) == (2, ""), argv
        assert err.strip().splitlines() == [f"dynamo-snapshot: {NOT_INSTALLED}"], err


def test_the_entry_point_says_the_demo_is_not_installed(tmp_path: Path) -> None:
    """`python -m dynamo_snapshot.cli.main`, as the image's `dynamo-snapshot` script runs it."""
    proc = _python(tmp_path, DEMO_MODULES, "-m", "dynamo_snapshot.cli.main", "demo")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"dynamo-snapshot: {NOT_INSTALLED}"


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """The stand-in for a missing file works: importing a blocked module fails in the subprocess."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(_BLOCKER))
    env = {**os.environ, "PYTHONPATH": str(site), "DSNAP_ABSENT_MODULES": "dynamo_snapshot.localcluster"}
    proc = subprocess.run(
        [sys.executable, "-c", "import dynamo_snapshot.localcluster"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "No module named 'dynamo_snapshot.localcluster'" in proc.stderr
