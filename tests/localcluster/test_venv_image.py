"""A worker image made of the host's own virtual environment: the CPU reference worker from this
machine's venv (Python 3.11 on a pyenv base), selected, streamed uncompressed into the real node's
containerd and run as a pod that serves, with the host's `sys.path` and none of the host's caches; the GPU
worker's selection (the venv and /usr whole) read off this host; the GPU pod's command is the one
`restore_bench.py` runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.distributions import SDK_PYPROJECT
from dynamo_snapshot_dev.localcluster.gpu_worker_image import (
    GPU_PYTHON,
    GPU_WORKER_SCRIPT,
    USR_SKIP,
    gpu_worker_command,
    gpu_worker_env,
    gpu_worker_spec,
)
from dynamo_snapshot_dev.localcluster.images import ImageBuildError, project_root
from dynamo_snapshot_dev.localcluster.realnode import RealNode
from dynamo_snapshot_dev.localcluster.realnode.host import CONTAINERD_NAMESPACE
from dynamo_snapshot_dev.localcluster.venv_image import (
    APP_DIR,
    WorkerImageSpec,
    build_and_import,
    python_facts,
    select,
)

CPU_SCRIPT = "examples/reference_worker/cpu_worker.py"
VENV_PYTHON = Path(sys.executable)
PORT = 8000


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A frozen copy of the sources the image takes: others may edit the checkout meanwhile."""
    src = project_root()
    dst = tmp_path / "repo"
    shutil.copytree(
        src / "dynamo_snapshot", dst / "dynamo_snapshot", ignore=shutil.ignore_patterns("__pycache__")
    )
    # The SDK's pyproject names the files a worker image takes.
    (dst / SDK_PYPROJECT).parent.mkdir(parents=True)
    shutil.copy2(src / SDK_PYPROJECT, dst / SDK_PYPROJECT)
    shutil.copytree(src / "examples" / "reference_worker", dst / "examples" / "reference_worker")
    return dst


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An installed-packages directory (as `pip install --target` makes) with a package of its own and
    the compile caches a careless host could leave there."""
    d = tmp_path / "site"
    (d / "sitecheck").mkdir(parents=True)
    (d / "sitecheck" / "__init__.py").write_text("ANSWER = 42\n")
    for cache in ("torchinductor_root/fx", ".triton/cache/abc"):
        (d / cache).mkdir(parents=True)
        (d / cache / "kernel.py").write_text("# compiled on the host\n")
    return d


def _cpu_spec(site: Path) -> WorkerImageSpec:
    return WorkerImageSpec(
        repository="localhost/dynamo-snapshot/venv-worker",
        python=VENV_PYTHON,
        script=CPU_SCRIPT,
        site_dirs=(site,),
    )


def test_cpu_worker_selection_takes_the_venv_at_its_host_paths(
    tmp_path: Path, repo: Path, site: Path
) -> None:
    facts = python_facts(VENV_PYTHON)
    sel = select(_cpu_spec(site), tmp_path / "staging", repo)
    by_path = {f.path: f for f in sel.files}
    # The interpreter as pods name it, and every link on the way to the base's binary.
    assert by_path[str(VENV_PYTHON).lstrip("/")].kind in ("file", "link")
    assert os.path.realpath(VENV_PYTHON).lstrip("/") in by_path
    if facts.libpython:
        assert os.path.realpath(facts.libpython).lstrip("/") in by_path
    stdlib = facts.stdlib.lstrip("/")
    assert f"{stdlib}/os.py" in by_path
    assert f"{stdlib}/lib-dynload" in by_path
    # The base's own site-packages is not on this venv's sys.path: it stays out.
    assert not any(p.startswith(f"{stdlib}/site-packages/") for p in by_path)
    assert f"{facts.prefix.lstrip('/')}/lib/python3.11/site-packages/pydantic/__init__.py" in by_path
    assert f"{facts.include.lstrip('/')}/Python.h" in by_path
    # What ldd finds for the interpreter and the extension modules: the C library, the loader.
    assert any(p.endswith("/libc.so.6") for p in by_path)
    assert any(f.kind == "file" and "ld-linux-x86-64" in f.path for f in sel.files)
    assert "etc/passwd" in by_path
    assert "etc/shadow" not in by_path
    assert "etc/hosts" not in by_path
    assert (by_path["tmp"].mode, by_path["root"].mode) == (0o1777, 0o700)
    envs = tuple(p.lstrip("/") for p in (facts.prefix, facts.base_prefix))
    stray = [
        p
        for p in by_path
        if p.startswith(("tmp/", "var/tmp/"))
        and not any(p == e or p.startswith(e + "/") or e.startswith(p + "/") for e in envs)
    ]
    assert stray == []
    # The sources and the site directory, compiled ahead (hash-based, unchecked), caches left out.
    app = APP_DIR.lstrip("/")
    pyc = by_path[f"{app}/dynamo_snapshot/workload/__pycache__/standby.cpython-311.pyc"]
    assert int.from_bytes(Path(pyc.source).read_bytes()[4:8], "little") == 0b01
    assert f"{app}/{CPU_SCRIPT}" in by_path
    assert f"{app}/site/sitecheck/__init__.py" in by_path
    assert not any("torchinductor_" in p or ".triton" in p for p in by_path)
    assert sorted(sel.report.walk.caches)[-2:] == sorted(
        str(tmp_path / "staging" / "root" / app / "site" / c) for c in (".triton", "torchinductor_root")
    )
    assert sel.config.entrypoint == (str(VENV_PYTHON), f"{APP_DIR}/{CPU_SCRIPT}")
    assert f"PYTHONPATH={APP_DIR}:{APP_DIR}/site" in sel.config.env


def test_tag_follows_the_sources_and_nothing_else(tmp_path: Path, repo: Path, site: Path) -> None:
    first = select(_cpu_spec(site), tmp_path / "a", repo).image
    assert select(_cpu_spec(site), tmp_path / "b", repo).image == first
    handshake = repo / "dynamo_snapshot" / "workload" / "handshake.py"
    handshake.write_text(handshake.read_text() + "\n# a change\n")
    assert select(_cpu_spec(site), tmp_path / "c", repo).image.tag != first.tag


def test_a_python_outside_a_venv_or_checkout_is_a_clear_error(tmp_path: Path, repo: Path) -> None:
    base = Path(python_facts(VENV_PYTHON).base_prefix) / "bin" / "python3"
    with pytest.raises(ImageBuildError, match="is not a virtual environment's interpreter"):
        select(WorkerImageSpec("localhost/x", base, CPU_SCRIPT), tmp_path / "a", repo)
    with pytest.raises(ImageBuildError, match="is not a dynamo-snapshot source checkout"):
        select(WorkerImageSpec("localhost/x", VENV_PYTHON, CPU_SCRIPT), tmp_path / "b", tmp_path)


def test_gpu_selection_on_this_host_is_the_venv_and_usr_less_documentation(
    tmp_path: Path, repo: Path
) -> None:
    """The GPU worker's selection, run here with this venv in the place of /opt/torch/.venv."""
    started = time.monotonic()
    sel = select(gpu_worker_spec(python=VENV_PYTHON), tmp_path, repo)
    seconds = time.monotonic() - started
    by_path = {f.path for f in sel.files}
    for kept in ("usr/bin/gcc", "usr/include/stdio.h", "usr/bin/ld", "usr/bin/sh", "etc/ld.so.cache"):
        if os.path.lexists("/" + kept):
            assert kept in by_path, kept
    for skipped in USR_SKIP:
        assert not any(p == f"usr/{skipped}" or p.startswith(f"usr/{skipped}/") for p in by_path), skipped
    assert f"{APP_DIR.lstrip('/')}/{GPU_WORKER_SCRIPT}" in by_path
    print(f"\nGPU-style selection here: {len(sel.files)} files, {sel.size / 1e9:.2f} GB in {seconds:.1f} s")


def test_gpu_pod_runs_the_worker_as_restore_bench_does() -> None:
    from benchmarks.gpu.restore_bench import MODES, Bench, worker_env

    args = Namespace(size="1g", kv_gib=8, worker_args="--batch-sizes 1,4")
    bench: Any = SimpleNamespace(args=args, model_dir=Path("/models/1g"))
    process = Bench.worker_cmd(bench, "decoupled", 18002)
    pod = gpu_worker_command(
        "1g",
        model_dir="/models/1g",
        kv_gib=8,
        port=18002,
        flags=[*MODES["decoupled"], "--batch-sizes", "1,4"],
    )
    # The same interpreter path and arguments; the script from the image's copy of the sources.
    assert pod[0] == str(GPU_PYTHON)
    assert pod[1] == f"{APP_DIR}/{GPU_WORKER_SCRIPT}"
    assert pod[2:] == process[2:]
    env = worker_env(Path("/cache"), 18002)
    assert {k: v for k, v in gpu_worker_env("/cache", 18002).items() if k in env} == {
        k: v for k, v in env.items() if k != "PYTHONPATH"
    }


# ------------------------------------------------------------------------------------------ the real node


def _exec_python(cluster: LocalCluster, namespace: str, pod: str, code: str, *args: str) -> Any:
    argv = ["exec", "-n", namespace, pod, "--", str(VENV_PYTHON), "-c", code, *args]
    out = cluster.kubectl(*argv, timeout=60)
    return json.loads(out.stdout)


_INSIDE = r"""
import json, os, sys, sitecheck, dynamo_snapshot.workload as w
caches = []
for d, dirs, files in os.walk("/"):
    if d in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    found = [n for n in dirs + files if n.startswith("torchinductor_") or n in (".triton", ".nv")]
    caches += [os.path.join(d, n) for n in found]
print(json.dumps({
    "path": sys.path, "sdk": w.__file__, "site": sitecheck.ANSWER, "caches": caches,
    "listed": {d: sorted(os.listdir(d)) for d in sys.argv[1:]},
}))
"""


def _expected_listings() -> dict[str, list[str]]:
    """/tmp, /root and every directory above the venv and its base, as the image has them: each holds
    only the next step towards the venv or the base (the host's hold much more), or nothing."""
    facts = python_facts(VENV_PYTHON)
    out: dict[str, set[str]] = {"/tmp": set(), "/root": set()}
    for tree in (facts.prefix, facts.base_prefix):
        parts = Path(tree).parts
        for i in range(1, len(parts) - 1):
            out.setdefault(str(Path(*parts[: i + 1])), set())
        for d in out:
            if tree.startswith(d + "/"):
                out[d].add(Path(tree).relative_to(d).parts[0])
    return {d: sorted(names) for d, names in out.items()}


def _host_path() -> list[str]:
    """This venv's sys.path for `python -c` with the image's PYTHONPATH, less the checkout an editable
    install adds (not in the image: its sources are at APP_DIR). That checkout need not be this one: a venv
    is shared by every checkout with the same pyproject files."""
    env = {"PYTHONPATH": f"{APP_DIR}:{APP_DIR}/site", "PATH": "/usr/bin:/bin"}
    code = "import json, sys; print(json.dumps(sys.path))"
    out = subprocess.run([str(VENV_PYTHON), "-c", code], env=env, capture_output=True, text=True, check=True)
    repo = str(project_root())

    def a_checkout(p: str) -> bool:
        # "" (the working directory) stays: the image's interpreter puts it first as well.
        return bool(p) and (p.startswith(repo) or (Path(p) / "dynamo_snapshot" / "__init__.py").is_file())

    return [p for p in json.loads(out.stdout) if not a_checkout(p)]


@pytest.mark.cluster
@pytest.mark.kubelet
def test_venv_image_serves_the_cpu_worker_on_the_real_node(
    cluster: LocalCluster, real_node: RealNode, namespace: str, repo: Path, site: Path
) -> None:
    said: list[str] = []
    ctr, sock = real_node.components.ctr, real_node.containerd_socket
    built = build_and_import(
        _cpu_spec(site), ctr, sock, namespace=CONTAINERD_NAMESPACE, repo=repo, say=said.append
    )
    print("\n" + "\n".join(said))
    assert not built.reused
    assert {"select_s", "stream_s", "unpack_s", "total_s"} <= set(built.timings)
    container = {
        "name": "worker",
        "image": built.image.name,
        "imagePullPolicy": "Never",
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "WORKER_HOST", "value": "0.0.0.0"},
            {"name": "WORKER_PORT", "value": str(PORT)},
            {"name": "WORKER_WEIGHTS_MIB", "value": "1"},
            {"name": "WORKER_COMPILE_ROUNDS", "value": "1000"},
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1},
    }
    cluster.apply(real_node.pod("venv-worker", [container], restartPolicy="Never"), namespace=namespace)
    cluster.kubectl(
        "wait", "-n", namespace, "--for=condition=Ready", "pod/venv-worker", "--timeout=120s", timeout=130
    )
    pod = json.loads(cluster.kubectl("get", "-n", namespace, "pod", "venv-worker", "-o", "json").stdout)
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{PORT}/health", timeout=10) as resp:
        assert json.loads(resp.read())["pod"] == "venv-worker"

    expected = _expected_listings()
    inside = _exec_python(cluster, namespace, "venv-worker", _INSIDE, *expected)
    assert inside["path"] == _host_path()
    assert inside["sdk"] == f"{APP_DIR}/dynamo_snapshot/workload/__init__.py"
    assert inside["site"] == 42
    # No compile cache, no temporary file and nothing beside the environment in the host's directories.
    assert inside["caches"] == []
    assert inside["listed"] == expected

    # The same inputs again: containerd has the image, nothing is streamed.
    again = build_and_import(
        _cpu_spec(site), ctr, sock, namespace=CONTAINERD_NAMESPACE, repo=repo, say=said.append
    )
    assert again.reused
    assert again.image == built.image
    assert "stream_s" not in again.timings


def test_gpu_site_dirs_are_checked() -> None:
    spec = gpu_worker_spec(site_dirs=[Path("/nonexistent-site")])
    assert spec.site_dirs == (Path("/nonexistent-site"),)
    assert spec.config().env[1] == f"PYTHONPATH={APP_DIR}:{APP_DIR}/site"
    assert spec.config().entrypoint == (str(GPU_PYTHON), f"{APP_DIR}/{GPU_WORKER_SCRIPT}")
    assert not spec.resolve_libraries
