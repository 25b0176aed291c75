"""The three distributions built from the one source tree, and the images that install two of them.

The wheels are built here (hatchling, without build isolation: the test tools include it) and their file
lists checked: the product (`dynamo-snapshot`) and the worker SDK (`dynamo-snapshot-sdk`) share no file
and together hold every file of `dynamo_snapshot`; neither holds any of the dev harness
(`dynamo-snapshot-dev`, `dynamo_snapshot_dev`); the SDK's modules import with the standard library alone;
the product's command line runs from the two wheels with no dev harness in reach. No Docker daemon here:
the build context each image gets is computed from its Dockerfile's ignore file with Docker's rules.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from functools import cache
from pathlib import Path

import pytest

import dynamo_snapshot
from dynamo_snapshot_dev.localcluster.distributions import sdk_files

REPO = Path(__file__).resolve().parents[1]
IMAGES = ("controller", "agent")
DISTRIBUTIONS = {"sdk": "dynamo_snapshot_sdk", ".": "dynamo_snapshot", "dev": "dynamo_snapshot_dev"}


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


def _package_files(package: str) -> set[str]:
    return {f for f in _repo_files() if f.startswith(f"{package}/") and "__pycache__" not in f}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each distribution's wheel, by its directory's name ("sdk", ".", "dev")."""
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + [f"./{d}" if d != "." else "." for d in DISTRIBUTIONS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for directory, stem in DISTRIBUTIONS.items():
        matches = list(out.glob(f"{stem}-{dynamo_snapshot.__version__}-*.whl"))
        assert len(matches) == 1, (stem, sorted(p.name for p in out.iterdir()))
        found[directory] = matches[0]
    return found


def _contents(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_the_product_and_the_sdk_split_the_package_and_hold_no_dev_code(wheels: dict[str, Path]) -> None:
    product, sdk, dev = (_contents(wheels[d]) for d in (".", "sdk", "dev"))
    assert not product & sdk, sorted(product & sdk)[:5]
    assert product | sdk == _package_files("dynamo_snapshot"), sorted(
        (product | sdk) ^ _package_files("dynamo_snapshot")
    )[:5]
    for name, files in (("product", product), ("sdk", sdk)):
        leaked = sorted(f for f in files if not f.startswith("dynamo_snapshot/"))
        assert not leaked, f"the {name} wheel holds files outside dynamo_snapshot: {leaked[:5]}"
    assert "dynamo_snapshot/cli/main.py" in product
    assert "dynamo_snapshot/workload/__init__.py" in sdk
    assert dev == _package_files("dynamo_snapshot_dev")
    # The worker images take the SDK's files from the same table the wheel is built from.
    assert {dest for _, dest in sdk_files(REPO)} == sdk


def _runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """`node` and everything under it, less `if TYPE_CHECKING:` blocks (imports for the type checker)."""
    if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
        return [child for orelse in node.orelse for child in _runtime_nodes(orelse)]
    return [node, *(n for child in ast.iter_child_nodes(node) for n in _runtime_nodes(child))]


def _imports(path: Path) -> list[str]:
    """The modules `path` imports when it runs (relative imports left out: the SDK uses none)."""
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_the_sdk_imports_only_the_standard_library_and_itself(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    with zipfile.ZipFile(wheels["sdk"]) as z:
        z.extractall(tmp_path)
    modules = sorted(
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__")
        for p in (tmp_path / "dynamo_snapshot").rglob("*.py")
    )
    # Every import statement, at module level or in a function: the standard library or the SDK itself.
    outside = [
        f"{p.relative_to(tmp_path)}: {name}"
        for p in sorted((tmp_path / "dynamo_snapshot").rglob("*.py"))
        for name in _imports(p)
        if name.split(".")[0] not in sys.stdlib_module_names and name not in modules
    ]
    assert not outside, outside
    # And importing each of them with nothing but the standard library on the path (-S: no site-packages).
    script = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "for m in json.loads(sys.argv[1]): importlib.import_module(m)\n"
        "loaded = {n.split('.')[0] for n in sys.modules} - {*sys.stdlib_module_names, '__main__'}\n"
        "print(json.dumps(sorted(loaded)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script, json.dumps(modules)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == ["dynamo_snapshot"]


# Imports every module of the two wheels and runs command lines through `main`, with the wheels' files
# first on the path and this interpreter's site-packages (the third-party requirements) after them, their
# .pth files unread: no editable install puts the working tree, and with it the dev harness, in reach.
_DRIVER = """
import contextlib, importlib, io, json, pkgutil, sys
sys.path[:0] = [sys.argv[1]]
sys.path += json.loads(sys.argv[3])
import dynamo_snapshot
assert dynamo_snapshot.__file__.startswith(sys.argv[1]), dynamo_snapshot.__file__
for m in pkgutil.walk_packages(dynamo_snapshot.__path__, "dynamo_snapshot."):
    importlib.import_module(m.name)
try:
    import dynamo_snapshot_dev
except ModuleNotFoundError:
    print(json.dumps("no dev harness"))
from dynamo_snapshot.cli.main import main
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, out.getvalue(), err.getvalue()]))
"""


def _site_packages() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]


def test_the_command_line_runs_from_the_product_and_sdk_wheels(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    site = tmp_path / "site"
    for d in (".", "sdk"):
        with zipfile.ZipFile(wheels[d]) as z:
            z.extractall(site)
    commands = ("controller", "agent", "crds", "identity")
    runs = [["--help"], *([c, "--help"] for c in commands), ["crds"], ["demo"]]
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _DRIVER,
            str(site),
            json.dumps(runs),
            json.dumps(_site_packages()),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, *lines = proc.stdout.splitlines()
    assert json.loads(first) == "no dev harness"
    results = dict(zip(map(tuple, runs), (json.loads(line) for line in lines), strict=True))
    code, out, err = results[("--help",)]
    assert code == 0, err
    for command in (*commands, "checkpoint"):
        assert command in out
    for command in commands:
        code, out, err = results[(command, "--help")]
        assert (code, err) == (0, ""), command
        assert f"dynamo-snapshot {command}" in out
    code, out, err = results[("crds",)]
    assert code == 0, err
    assert "CustomResourceDefinition" in out
    code, out, err = results[("demo",)]
    assert code == 2
    assert "invalid choice: 'demo'" in err


def test_the_versions_and_pins_agree() -> None:
    """The three pyproject files carry the package's version, and each pins the one below it to it."""
    projects = {d: tomllib.loads((REPO / d / "pyproject.toml").read_text())["project"] for d in DISTRIBUTIONS}
    version = dynamo_snapshot.__version__
    assert {p["version"] for p in projects.values()} == {version}
    assert f"dynamo-snapshot-sdk=={version}" in projects["."]["dependencies"]
    assert f"dynamo-snapshot-sdk[gpu]=={version}" in projects["."]["optional-dependencies"]["gpu"]
    assert f"dynamo-snapshot=={version}" in projects["dev"]["dependencies"]
    assert projects["dev"]["scripts"] == {"dynamo-snapshot-demo": "dynamo_snapshot_dev.demo.command:main"}


# --------------------------------------------------------------------------- the images' build contexts


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


def _copied(image: str) -> set[str]:
    """The context's files the Dockerfile's COPY lines take."""
    context = build_context(image)
    sources = [
        source
        for line in (REPO / image / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    ]
    for source in sources:
        assert any(f == source or f.startswith(source + "/") for f in context), (image, source)
    return {f for f in context if any(f == s or f.startswith(s + "/") for s in sources)}


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_gets_the_product_and_the_sdk_and_no_dev_harness(image: str) -> None:
    copied = _copied(image)
    assert not [f for f in build_context(image) if f.startswith(("dynamo_snapshot_dev/", "dev/"))]
    assert not [f for f in copied if "__pycache__" in f]
    # What `pip install ./sdk .` reads: both pyproject files, the SDK's build hook, every source file.
    assert {"pyproject.toml", "sdk/pyproject.toml"} <= copied
    hook = tomllib.loads((REPO / "sdk/pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]
    hook_path = os.path.normpath(Path("sdk") / hook["wheel"]["hooks"]["custom"]["path"])
    assert hook_path in copied
    missing = _package_files("dynamo_snapshot") - copied
    assert not missing, sorted(missing)[:5]
    assert "./sdk" in (REPO / image / "Dockerfile").read_text()
