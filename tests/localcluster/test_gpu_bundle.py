"""scripts/gpu_bundle.py: the node's binaries packed for the GPU machine (xz, a manifest of sizes and
digests, a budget) and unpacked there by Python's standard library alone, laid out as the cache's bin dir
is here, links included. A small fake bin dir stands in for the real one (whose packing takes minutes)."""

from __future__ import annotations

import importlib.util
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bundle.py"
LINKS = ("kube-apiserver", "kubelet", "containerd", "containerd-shim-runc-v2", "etcd", "gpu-device-plugin")


@pytest.fixture(scope="module")
def bundle_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bundle"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A bin dir shaped like test-env.sh's: the multi-call program and its links, runc, cni/, criu (here a
    copy of ls, which links shared libraries beside glibc as CRIU does)."""
    base = tmp_path / "bin"
    (base / "cni").mkdir(parents=True)
    (base / "dsnap-multicall").write_bytes(os.urandom(300_000) + b"\0" * 700_000)
    for name in LINKS:
        (base / name).symlink_to("dsnap-multicall")
    (base / "runc").write_bytes(b"runc" * 50_000)
    for plugin in ("bridge", "host-local", "loopback"):
        (base / "cni" / plugin).write_bytes(plugin.encode() * 10_000)
    shutil.copy(shutil.which("ls") or "/bin/ls", base / "criu")
    (base / "kwok").write_bytes(b"not for the node")
    (base / "helm").symlink_to("kwok")
    for p in base.rglob("*"):
        if p.is_file() and not p.is_symlink():
            p.chmod(0o755)
    return base


def _tree(root: Path) -> dict[str, tuple[str, str | bytes, int]]:
    out: dict[str, tuple[str, str | bytes, int]] = {}
    for p in sorted(root.rglob("*")):
        name = str(p.relative_to(root))
        if p.is_symlink():
            out[name] = ("link", os.readlink(p), 0)
        elif p.is_file():
            out[name] = ("file", p.read_bytes(), p.stat().st_mode & 0o777)
    return out


def _unpack_isolated(bundle: Path, into: Path) -> subprocess.CompletedProcess[str]:
    """The unpacking as the GPU machine runs it: no site-packages, no project on the path."""
    argv = [sys.executable, "-I", "-S", str(SCRIPT), "unpack", str(bundle), "--into", str(into)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_pack_and_unpack_round_trip(bundle_tool: ModuleType, bin_dir: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    manifest = bundle_tool.pack(bundle, bin_dir, 50.0, bin_dir / "criu")
    assert json.loads((bundle / "manifest.json").read_text()) == manifest
    names = {e["name"] for e in manifest["files"]}
    assert names >= {
        "dsnap-multicall",
        "runc",
        "cni/bridge",
        "cni/host-local",
        "cni/loopback",
        "criu-bundle/criu",
    }
    assert "kwok" not in names, "only what a node needs"
    assert manifest["links"] == dict.fromkeys(sorted(LINKS), "dsnap-multicall")
    for entry in manifest["files"]:
        with lzma.open(bundle / entry["xz"]) as f:
            assert len(f.read()) == entry["size"], "each part is an xz stream of the file"
    multicall = next(e for e in manifest["files"] if e["name"] == "dsnap-multicall")
    assert multicall["xz_size"] < multicall["size"] / 2

    into = tmp_path / "device" / "bin"
    proc = _unpack_isolated(bundle, into)
    assert proc.returncode == 0, proc.stderr
    here, there = _tree(bin_dir), _tree(into)
    for name in ["dsnap-multicall", *LINKS, "runc", "cni/bridge", "cni/host-local", "cni/loopback"]:
        assert there[name] == here[name], name
    assert there["criu-bundle/criu"] == here["criu"]
    libs = [n for n in there if n.startswith("criu-bundle/lib/")]
    assert libs, "CRIU's shared libraries travel with it"
    assert not [n for n in libs if "/libc.so" in n], "glibc is the machine's"
    # criu runs through a wrapper that gives it the libraries it was bundled with.
    assert subprocess.run([into / "criu", "--version"], capture_output=True, check=False).returncode == 0
    assert f"LD_LIBRARY_PATH={into.resolve() / 'criu-bundle'}/lib" in (into / "criu").read_text()
    assert not [p for p in into.rglob(".*unpacking")], "no partial file left"
    # Unpacked again over itself (a machine kept from an earlier call): the same tree.
    again = _unpack_isolated(bundle, into)
    assert again.returncode == 0, again.stderr
    assert _tree(into) == there


def test_over_the_budget_is_refused_naming_the_largest(
    bundle_tool: ModuleType, bin_dir: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    with pytest.raises(bundle_tool.BundleError, match=r"over the 0\.1 MiB budget; largest: dsnap-multicall "):
        bundle_tool.pack(bundle, bin_dir, 0.1, None)
    assert not bundle.exists(), "nothing half-packed is left to carry"


def test_a_damaged_part_is_refused_and_not_installed(
    bundle_tool: ModuleType, bin_dir: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    bundle_tool.pack(bundle, bin_dir, 50.0, None)
    (bundle / "runc.xz").write_bytes(lzma.compress(b"another runc", format=lzma.FORMAT_XZ))
    into = tmp_path / "device" / "bin"
    proc = _unpack_isolated(bundle, into)
    assert proc.returncode == 1
    assert "gpu_bundle: runc: 12 bytes with SHA-256" in proc.stderr
    assert not (into / "runc").exists()
    assert not [p for p in into.rglob(".*unpacking")]


def test_pack_refuses_what_is_not_built_or_a_dir_that_is_not_a_bundle(
    bundle_tool: ModuleType, bin_dir: Path, tmp_path: Path
) -> None:
    (bin_dir / "runc").unlink()
    with pytest.raises(bundle_tool.BundleError, match=r"not built: .*/bin/runc: run scripts/test-env\.sh"):
        bundle_tool.pack(tmp_path / "bundle", bin_dir, 50.0, None)
    (bin_dir / "runc").write_bytes(b"runc")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(bundle_tool.BundleError, match="not a bundle to replace"):
        bundle_tool.pack(precious, bin_dir, 50.0, None)
    assert (precious / "notes.txt").read_text() == "keep me"
