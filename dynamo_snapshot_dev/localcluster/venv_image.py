"""A worker image made of the host's own Python virtual environment, built on the machine it runs on.

The image holds, at their host paths (`host_trees`):
- the virtual environment, whole (its interpreter path and `sys.path` are the host's);
- the base interpreter's standard library (less a `site-packages` that is not on the venv's `sys.path`),
  its headers (Triton and inductor compile C against Python.h at run time), the interpreter binary and
  `libpython` with the symlinks that lead to them;
- `WorkerImageSpec.trees`, host trees taken whole (the GPU worker's /usr: the compiler toolchain, the
  system libraries and the CUDA toolkit, less documentation);
- with `resolve_libraries`, every shared library `ldd` finds for the ELF files of the selection (where
  no tree holds the system's libraries);
- /etc less secrets and the files the kubelet mounts over, and the root's merged-/usr links (/bin, /lib,
  /lib64, /sbin);
- empty /tmp, /var/tmp and /root: no compile cache of the host's reaches the image (`host_trees` leaves
  out every cache directory it meets), so a worker from it compiles from nothing, as on a new node;
- in `APP_DIR`: the worker SDK's sources (the files of sdk/pyproject.toml's wheel), the worker's directory
  of examples/ and `site_dirs` (installed packages, e.g. `pip install --target`) in `APP_DIR/site`, all
  compiled ahead to bytecode by the image's own interpreter (hash-based, unchecked: a restore pod's
  standby placeholder starts without compiling the SDK). `PYTHONPATH` names them, sources first.

The tag hashes the host files' metadata and the staged files' contents (`host_trees.HostFile.describe`),
so a machine whose environment did not change finds its image already imported and builds nothing. The
layer is streamed into `ctr images import` (`ctr_import`, `layer_stream`), never written as a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dynamo_snapshot_dev.localcluster.ctr_import import ImportTimings, image_present, import_streamed
from dynamo_snapshot_dev.localcluster.host_trees import (
    HostFile,
    SelectionError,
    Tree,
    WalkReport,
    host_file,
    merge,
    path_chain,
    total_bytes,
    walk_tree,
)
from dynamo_snapshot_dev.localcluster.images import ImageBuildError, ImageRef, project_root, worker_sdk_files
from dynamo_snapshot_dev.localcluster.layer_stream import (
    ImageConfig,
    LayerStream,
    StreamStats,
    write_oci_file,
)

APP_DIR = "/opt/dynamo-snapshot"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Secrets and the host's identity stay out; hosts, hostname and resolv.conf are the kubelet's to mount.
ETC_SKIP = frozenset({
    "shadow", "shadow-", "gshadow", "gshadow-", "ssh", "ssl/private", "sudoers", "sudoers.d", "machine-id",
    "hosts", "hostname", "resolv.conf", "security/opasswd",
})  # fmt: skip
EMPTY_DIRS = {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}
LDD_BATCH = 64
_FACTS = r"""
import json, os, sys, sysconfig
paths = sysconfig.get_paths()
libdir = sysconfig.get_config_var("LIBDIR") or ""
library = sysconfig.get_config_var("LDLIBRARY") or ""
shared = bool(sysconfig.get_config_var("Py_ENABLE_SHARED"))
print(json.dumps({
    "prefix": sys.prefix, "base_prefix": sys.base_prefix, "stdlib": paths["stdlib"],
    "platstdlib": paths["platstdlib"], "include": paths["include"],
    "libpython": os.path.join(libdir, library) if shared and library else "", "path": sys.path,
}))
"""


@dataclass(frozen=True)
class PythonFacts:
    """What the image's interpreter says about itself (run isolated: no PYTHONPATH, no user site)."""

    prefix: str
    base_prefix: str
    stdlib: str
    platstdlib: str
    include: str
    libpython: str
    path: tuple[str, ...]


def python_facts(python: Path) -> PythonFacts:
    try:
        proc = subprocess.run(
            [str(python), "-I", "-c", _FACTS], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as e:
        raise ImageBuildError(f"{python} does not run: {e}") from None
    if proc.returncode != 0:
        raise ImageBuildError(f"{python} does not run: {proc.stderr.strip()}")
    raw = json.loads(proc.stdout)
    facts = PythonFacts(**{**raw, "path": tuple(raw["path"])})
    if facts.prefix == facts.base_prefix:
        raise ImageBuildError(
            f"{python} is not a virtual environment's interpreter (sys.prefix is its base, {facts.prefix}): "
            "the image takes a venv whole"
        )
    return facts


@dataclass(frozen=True)
class WorkerImageSpec:
    """A worker image: `python` (a venv's interpreter, at the path pods run it) runs `script` (a path in
    the source checkout) with the project's sources and `site_dirs` on PYTHONPATH."""

    repository: str
    python: Path
    script: str
    trees: tuple[Tree, ...] = ()
    resolve_libraries: bool = True
    site_dirs: tuple[Path, ...] = ()
    env: tuple[str, ...] = ("PYTHONUNBUFFERED=1",)
    # Absolute host paths left out of whichever tree holds them.
    skip: frozenset[str] = frozenset()

    @property
    def site_dests(self) -> list[str]:
        return [f"{APP_DIR}/site" + (f"-{i + 1}" if i else "") for i in range(len(self.site_dirs))]

    def config(self) -> ImageConfig:
        pythonpath = ":".join([APP_DIR, *self.site_dests])
        env = (f"PATH={self.python.parent}:{SYSTEM_PATH}", f"PYTHONPATH={pythonpath}", *self.env)
        return ImageConfig(entrypoint=(str(self.python), f"{APP_DIR}/{self.script}"), env=env)


@dataclass
class SelectionReport:
    """What the selection left out or could not find, for the build's summary."""

    walk: WalkReport = field(default_factory=WalkReport)
    missing_libraries: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"left out (other filesystem, e.g. a driver mount the node injects): {p}"
            for p in self.walk.other_mounts
        ]
        out += [f"left out (a cache): {p}" for p in self.walk.caches]
        out += [f"left out (socket, FIFO or device): {p}" for p in self.walk.special]
        out += [f"not found by ldd (the host lacks it too): {m}" for m in self.missing_libraries]
        return out


@dataclass(frozen=True)
class Selection:
    image: ImageRef
    config: ImageConfig
    files: list[HostFile]
    report: SelectionReport

    @property
    def size(self) -> int:
        return total_bytes(self.files)


def _environment_trees(facts: PythonFacts) -> list[Tree]:
    trees = [Tree(Path(facts.prefix))]
    for lib in dict.fromkeys((facts.stdlib, facts.platstdlib)):
        # The base's own site-packages is on sys.path only for a venv made with --system-site-packages.
        skip = frozenset(
            name for name in ("site-packages", "dist-packages") if os.path.join(lib, name) not in facts.path
        )
        trees.append(Tree(Path(lib), skip))
    if os.path.isdir(facts.include):
        trees.append(Tree(Path(facts.include)))
    return trees


def _root_links() -> list[HostFile]:
    """The root's links into /usr (merged /usr: /bin, /lib, /lib64, /sbin)."""
    found = []
    with os.scandir("/") as it:
        for e in it:
            if e.is_symlink() and os.readlink(e.path).lstrip("/").startswith("usr/"):
                found.append(host_file(e.path))
    return found


def _empty_dirs() -> list[HostFile]:
    return [HostFile(path, "dir", mode=mode, uid=0, gid=0) for path, mode in EMPTY_DIRS.items()]


def _is_elf(f: HostFile) -> bool:
    if f.kind != "file" or f.size < 64 or not (f.mode & 0o111 or ".so" in f.path.rsplit("/", 1)[-1]):
        return False
    try:
        with open(f.source, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def _ldd(paths: Sequence[str], report: SelectionReport) -> set[str]:
    """The libraries `ldd` resolves for `paths`, as the loader asks for them."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise ImageBuildError(
            "ldd is missing (the image resolves its ELF files' libraries): apt-get install libc-bin"
        )
    found: set[str] = set()
    for i in range(0, len(paths), LDD_BATCH):
        batch = list(paths[i : i + LDD_BATCH])
        proc = subprocess.run([ldd, *batch], capture_output=True, text=True, timeout=300, check=False)
        current = batch[0]
        for line in proc.stdout.splitlines():
            if not line.startswith(("\t", " ")) and line.endswith(":"):
                current = line[:-1]
                continue
            left, arrow, right = line.strip().partition("=>")
            target = (right if arrow else left).strip().split(" (")[0].strip()
            if target == "not found":
                report.missing_libraries.append(f"{left.strip()} (needed by {current})")
            elif target.startswith("/"):
                found.add(target)
    return found


def _stage_app(spec: WorkerImageSpec, repo: Path, staging: Path, report: WalkReport) -> list[HostFile]:
    """The project's sources, the worker's directory and `site_dirs`, copied under `staging` and compiled
    to bytecode by the image's interpreter, as image files (root-owned, time 0: the bytecode is unchecked)."""
    script_dir = (repo / spec.script).parent
    if (
        not (repo / "dynamo_snapshot" / "workload" / "__init__.py").is_file()
        or not (repo / spec.script).is_file()
    ):
        raise ImageBuildError(
            f"{repo} is not a dynamo-snapshot source checkout ({spec.script} or dynamo_snapshot/workload is "
            "missing): the worker image is built from the sources"
        )
    root = staging / "root"
    app = root / APP_DIR.lstrip("/")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for src, dest in worker_sdk_files(repo):
        (app / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, app / dest)
    shutil.copytree(script_dir, app / script_dir.relative_to(repo), ignore=ignore)
    for src, dest in zip(spec.site_dirs, spec.site_dests, strict=True):
        if not src.is_dir():
            raise ImageBuildError(f"{src} is not a directory of installed packages")
        shutil.copytree(src, root / dest.lstrip("/"), ignore=ignore, symlinks=True)
    argv = [
        str(spec.python),
        "-I",
        "-m",
        "compileall",
        "-q",
        "-j",
        "0",
        "--invalidation-mode",
        "unchecked-hash",
    ]
    proc = subprocess.run(
        [*argv, "-s", str(root), "-p", "/", str(app)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageBuildError(f"compiling the image's sources failed: {(proc.stdout + proc.stderr)[-2000:]}")
    staged = []
    for f in walk_tree(Tree(app), report):
        rel = os.path.relpath("/" + f.path, root)
        staged.append(replace(f, path=rel, src="/" + f.path, uid=0, gid=0, mtime_ns=0, inode=None))
    return staged


def _with_skips(tree: Tree, skip: Iterable[str]) -> Tree:
    root = str(tree.root)
    inside = {os.path.relpath(p, root) for p in skip if p.startswith(root + "/")}
    return Tree(tree.root, tree.skip | inside) if inside else tree


def _tag(config: ImageConfig, files: Iterable[HostFile]) -> str:
    digest = hashlib.sha256(config.describe())
    for f in files:
        digest.update(f.describe())
        if f.src and f.kind == "file":  # staged: by content
            digest.update(hashlib.sha256(Path(f.src).read_bytes()).digest())
    return digest.hexdigest()[:12]


def select(spec: WorkerImageSpec, staging: Path, repo: Path | None = None) -> Selection:
    """Everything `spec`'s image holds (staged files under `staging`, which must outlive the build)."""
    repo = repo or project_root()
    facts = python_facts(spec.python)
    report = SelectionReport()
    app = _stage_app(spec, repo, staging, report.walk)
    try:
        groups: list[list[HostFile]] = [_empty_dirs(), app]
        for tree in (*_environment_trees(facts), *spec.trees, Tree(Path("/etc"), ETC_SKIP)):
            groups.append(list(walk_tree(_with_skips(tree, spec.skip), report.walk)))
        chains = [path_chain(str(spec.python)), _root_links()]
        if facts.libpython:
            chains.append(path_chain(facts.libpython))
        files = merge(*groups, *chains)
        if spec.resolve_libraries:
            elves = [f.source for f in files if _is_elf(f)]
            libraries = [path_chain(lib) for lib in sorted(_ldd(elves, report))]
            files = merge(files, *libraries)
    except SelectionError as e:
        raise ImageBuildError(str(e)) from None
    config = spec.config()
    return Selection(ImageRef(spec.repository, _tag(config, files)), config, files, report)


@dataclass(frozen=True)
class BuiltImage:
    """The image a build made or found, with its size and the seconds of each phase."""

    image: ImageRef
    files: int
    size: int
    reused: bool
    timings: dict[str, float]


def _summary(sel: Selection, timings: dict[str, float], imported: ImportTimings | None) -> str:
    gb = sel.size / 1e9
    parts = [f"{sel.image.name}: {len(sel.files)} files, {gb:.2f} GB"]
    parts += [f"{k} {v:.1f} s" for k, v in timings.items()]
    if imported is not None:
        parts.append(
            f"stream {imported.stream_gbps:.2f} GB/s, build+import {gb / timings['total_s']:.2f} GB/s"
        )
    return "; ".join(parts)


def build_and_import(
    spec: WorkerImageSpec,
    ctr: Path,
    containerd_socket: Path,
    *,
    namespace: str,
    repo: Path | None = None,
    say: Callable[[str], None] = print,
) -> BuiltImage:
    """Select, then stream the image into containerd unless an image of that tag is there already."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="worker-image-") as tmp:
        sel = select(spec, Path(tmp), repo)
        timings = {"select_s": time.monotonic() - started}
        for line in sel.report.lines():
            say(line)
        if image_present(ctr, containerd_socket, sel.image, namespace):
            timings["total_s"] = time.monotonic() - started
            say(f"reused {_summary(sel, timings, None)}")
            return BuiltImage(sel.image, len(sel.files), sel.size, True, timings)
        say(f"importing {sel.image.name}: {len(sel.files)} files, {sel.size / 1e9:.2f} GB")
        imported = import_streamed(ctr, containerd_socket, LayerStream(sel.files), sel.image, sel.config,
                                   namespace=namespace)  # fmt: skip
    timings |= {"stream_s": imported.stream_s, "unpack_s": imported.unpack_s}
    timings["total_s"] = time.monotonic() - started
    say(f"imported {_summary(sel, timings, imported)}")
    return BuiltImage(sel.image, len(sel.files), sel.size, False, timings)


def write_archive(
    spec: WorkerImageSpec, out: Path, repo: Path | None = None
) -> tuple[Selection, StreamStats]:
    """The image's OCI archive as a file (what the import streams), for inspection and tests."""
    with tempfile.TemporaryDirectory(prefix="worker-image-") as tmp:
        sel = select(spec, Path(tmp), repo)
        return sel, write_oci_file(out, LayerStream(sel.files), sel.image, sel.config)
