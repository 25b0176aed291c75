"""The controller and node-agent images, built on this machine as controller/Dockerfile and
agent/Dockerfile describe them (no registry is reachable here), for the Helm chart on the real node.

Both hold Debian's python3.11 with the shared libraries it and the extension modules load (as the worker
image, localcluster/images.py), the `dynamo_snapshot` sources (the product's and the worker SDK's it
depends on, as the Dockerfiles install them; the dev harness is a package of its own), the third-party
modules those sources import, copied from the running interpreter's site-packages, a
`/usr/bin/dynamo-snapshot` script (the chart's `command` names it) and busybox for `sh` and `kubectl exec`.
The entrypoint and the default config file are the Dockerfiles':
`dynamo-snapshot controller|agent --config /etc/dynamo-snapshot/<controller|agent>.yaml`.

The controller image runs as uid 65532. The agent image also carries the host programs the agent execs in
its container: CRIU >= 4 (the one `find_criu` picks: $DYNSNAP_CRIU or PATH), runc (agent/runtime/
containerd.py and runc.py: `runc state`, `runc run`), util-linux's nsenter and unshare (containerd.py runs a
restore inside the placeholder's namespaces with them), dash as /bin/sh (the cgroup-joining and host-name
scripts) and busybox's cat, printf, cp, mv and mkdir (those scripts, the chart's seccomp-profile init
container). The `gpu` extra
(cuda-python, nvidia-ml-py) goes in only where the running interpreter has it installed.

The tags hash every input (`controller_image`, `agent_image`); `*_image_archive` keeps the OCI archive in
`<cache>/images/<name>-<tag>.tar` and builds it only when absent. Each archive names its image twice: with
that tag and with `LOCAL_TAG`, the tag helm/dynamo-snapshot/values-local.yaml installs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamo_snapshot.criu import MIN_VERSION, CriuError, CriuVersion, find_criu
from dynamo_snapshot_dev.localcluster.components import cache_dir
from dynamo_snapshot_dev.localcluster.images import (
    BUSYBOX_APPLETS,
    WORKER_DIST_PACKAGES,
    WORKER_PYTHON,
    Entry,
    ImageBuildError,
    ImageRef,
    busybox_entries,
    compile_bytecode,
    file_entry,
    materialize,
    native_library_entries,
    project_root,
    python_entries,
    site_package_entries,
    tree_entries,
    write_oci_archive,
)

CONTROLLER_REPOSITORY = "localhost/dynamo-snapshot/controller"
AGENT_REPOSITORY = "localhost/dynamo-snapshot/agent"
CONTROLLER_UID = 65532
# The second name each archive gives its image, which helm/dynamo-snapshot/values-local.yaml names: one
# values file serves every build (the content tag changes with every edit of the sources).
LOCAL_TAG = "local"
IMAGE_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
)
ENTRY_SCRIPT = "usr/bin/dynamo-snapshot"
# Guarded as pip's console scripts are: the artifact checks' helper processes are started with "spawn",
# which runs the main module again in each child (as __mp_main__); unguarded, every helper would be a
# second agent.
ENTRY_SCRIPT_TEXT = (
    f"#!{WORKER_PYTHON}\nimport sys\n\nfrom dynamo_snapshot.cli.main import main\n\n"
    'if __name__ == "__main__":\n    sys.exit(main())\n'
)
# Those the agent's `gpu` extra installs (the CUDA checkpoint API, NVML): copied where installed.
GPU_PACKAGES = ("cuda", "pynvml")
AGENT_APPLETS = (*BUSYBOX_APPLETS, "cp", "mv")
AGENT_TOOLS = {
    "runc": "usr/sbin/runc",
    "nsenter": "usr/bin/nsenter",
    "unshare": "usr/bin/unshare",
    "dash": "bin/sh",
    # CRIU saves and restores a tmpfs's files (a pod's /dev/shm, an emptyDir in memory) with
    # `tar --gzip`, which runs gzip.
    "tar": "usr/bin/tar",
    "gzip": "usr/bin/gzip",
}
# Debian's busybox sh runs its own applet for a command of that name even where PATH names another
# program: `exec nsenter --pid=...` in the agent's cgroup-joining script would get busybox's nsenter, not
# util-linux's. The agent's /bin/sh is dash (as in debian:trixie-slim), which looks commands up in PATH.
_TOOL_PACKAGES = {
    "runc": "runc",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "dash": "dash",
    "tar": "tar",
    "gzip": "gzip",
}
ETC_PASSWD = (
    "root:x:0:0:root:/:/bin/sh\ncontroller:x:65532:65532::/:/bin/false\nnobody:x:65534:65534::/:/bin/false\n"
)
ETC_GROUP = "root:x:0:\ncontroller:x:65532:\nnogroup:x:65534:\n"

# Run by the image's future interpreter's twin (this venv's): imports every production module and names
# the top-level site-packages modules that got loaded, which is what the image must carry.
_LIST_IMPORTS = """
import importlib, json, pkgutil, sys
import dynamo_snapshot
for m in pkgutil.walk_packages(dynamo_snapshot.__path__, "dynamo_snapshot."):
    importlib.import_module(m.name)
sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
found = set()
for mod in list(sys.modules.values()):
    f = getattr(mod, "__file__", None) or ""
    for site in sites:
        if f.startswith(site + "/"):
            found.add(f[len(site) + 1:].split("/")[0].split(".")[0])
print(json.dumps(sorted(found)))
"""
# Import machinery of the venv itself (editable installs, setuptools' shim), not anything the code uses.
_NOT_RUNTIME_PREFIXES = ("__editable__", "_distutils_hack", "dynamo_snapshot")


@dataclass(frozen=True)
class _Spec:
    name: str
    repository: str
    config_src: str
    config_dest: str
    command: str
    user: str

    @property
    def entrypoint(self) -> tuple[str, ...]:
        return ("dynamo-snapshot", self.command, "--config", "/" + self.config_dest)


CONTROLLER = _Spec(
    "controller",
    CONTROLLER_REPOSITORY,
    "controller/config.yaml",
    "etc/dynamo-snapshot/controller.yaml",
    "controller",
    str(CONTROLLER_UID),
)
AGENT = _Spec("agent", AGENT_REPOSITORY, "agent/config.yaml", "etc/dynamo-snapshot/agent.yaml", "agent", "")


def runtime_modules(repo: Path) -> list[str]:
    """The third-party top-level modules the production sources in `repo` import, all modules loaded."""
    proc = subprocess.run(
        [sys.executable, "-c", _LIST_IMPORTS],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageBuildError(f"importing the production modules of {repo} failed: {proc.stderr.strip()}")
    names: list[str] = json.loads(proc.stdout)
    return [n for n in names if not n.startswith(_NOT_RUNTIME_PREFIXES)]


def _sources(repo: Path) -> list[Entry]:
    src = repo / "dynamo_snapshot"
    if not (src / "cli" / "main.py").is_file():
        raise ImageBuildError(
            f"{repo} is not a dynamo-snapshot source checkout (dynamo_snapshot/cli/main.py is missing): "
            "the images are built from the sources"
        )
    dest = f"{WORKER_DIST_PACKAGES}/dynamo_snapshot"
    return [e for e in tree_entries(src, dest) if not e.dest.endswith(".pyc")]


def _criu() -> Path:
    try:
        binary = find_criu()
    except CriuError as e:
        raise ImageBuildError(f"the agent image carries CRIU: {e}") from None
    if binary.read_bytes()[:4] != b"\x7fELF":
        raise ImageBuildError(
            f"{binary} is not an ELF binary (a wrapper?): the agent image needs CRIU itself"
        )
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    try:
        version = CriuVersion.parse(proc.stdout)
    except ValueError:
        raise ImageBuildError(f"{binary} --version said {proc.stdout.strip()!r}") from None
    if not version.at_least(MIN_VERSION):
        raise ImageBuildError(
            f"{binary} is CRIU {version}; the agent needs >= {MIN_VERSION[0]}.{MIN_VERSION[1]}"
        )
    return binary


def _agent_tools() -> list[Entry]:
    entries = [file_entry("usr/sbin/criu", _criu())]
    for tool, dest in AGENT_TOOLS.items():
        found = shutil.which(tool)
        if found is None:
            raise ImageBuildError(
                f"{tool} is missing (the agent image carries it): apt-get install {_TOOL_PACKAGES[tool]}"
            )
        entries.append(file_entry(dest, Path(found)))
    return entries


def _entries(spec: _Spec, repo: Path) -> list[Entry]:
    """Everything `spec`'s image holds, in a fixed order."""
    sources = _sources(repo)
    config = repo / spec.config_src
    if not config.is_file():
        raise ImageBuildError(f"{config} is missing: the {spec.name} image's default configuration")
    entries = python_entries()
    entries += site_package_entries(runtime_modules(repo), optional=GPU_PACKAGES if spec is AGENT else ())
    entries += sources
    entries.append(Entry(ENTRY_SCRIPT, data=ENTRY_SCRIPT_TEXT.encode(), mode=0o755))
    entries.append(file_entry(spec.config_dest, config))
    tools = _agent_tools() if spec is AGENT else []
    entries += tools
    entries += native_library_entries(entries, [t.src for t in tools if t.src])
    box = busybox_entries(AGENT_APPLETS if spec is AGENT else BUSYBOX_APPLETS)
    replaced = {"etc/passwd", "etc/group", *(t.dest for t in tools)}
    entries += (e for e in box if e.dest not in replaced)
    entries += [Entry("etc/passwd", data=ETC_PASSWD.encode()), Entry("etc/group", data=ETC_GROUP.encode())]
    return sorted(entries, key=lambda e: e.dest)


def _ref(spec: _Spec, entries: Sequence[Entry]) -> ImageRef:
    digest = hashlib.sha256()
    digest.update(json.dumps({"entrypoint": spec.entrypoint, "env": IMAGE_ENV, "user": spec.user}).encode())
    for e in entries:
        digest.update(e.describe())
    return ImageRef(spec.repository, digest.hexdigest()[:12])


def _archive(spec: _Spec, repo: Path | None, cache: Path | None) -> tuple[ImageRef, Path]:
    entries = _entries(spec, repo or project_root())
    image = _ref(spec, entries)
    images = (cache or cache_dir()) / "images"
    out = images / f"{spec.name}-{image.tag}.tar"
    if out.is_file():
        return image, out
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{spec.name}-build-", dir=images) as tmp:
        rootfs = materialize(Path(tmp) / "rootfs", entries)
        compile_bytecode(rootfs, ("usr/lib/python3.11", WORKER_DIST_PACKAGES))
        archive = write_oci_archive(
            Path(tmp) / "image.tar",
            rootfs,
            image,
            entrypoint=spec.entrypoint,
            env=IMAGE_ENV,
            user=spec.user,
            also=[ImageRef(spec.repository, LOCAL_TAG)],
            compresslevel=1,
        )
        os.replace(archive, out)
    for old in images.glob(f"{spec.name}-*.tar"):
        if old != out:
            old.unlink(missing_ok=True)
    return image, out


def controller_image(repo: Path | None = None) -> ImageRef:
    """The controller image's name for the current inputs (nothing is built)."""
    return _ref(CONTROLLER, _entries(CONTROLLER, repo or project_root()))


def agent_image(repo: Path | None = None) -> ImageRef:
    """The node agent image's name for the current inputs (nothing is built)."""
    return _ref(AGENT, _entries(AGENT, repo or project_root()))


def controller_image_archive(repo: Path | None = None, cache: Path | None = None) -> tuple[ImageRef, Path]:
    """The controller image and its OCI archive in `<cache>/images/controller-<tag>.tar`, built only when
    absent; archives of other tags are removed."""
    return _archive(CONTROLLER, repo, cache)


def agent_image_archive(repo: Path | None = None, cache: Path | None = None) -> tuple[ImageRef, Path]:
    """The node agent image and its OCI archive in `<cache>/images/agent-<tag>.tar`, built only when
    absent; archives of other tags are removed."""
    return _archive(AGENT, repo, cache)
