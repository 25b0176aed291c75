"""The components scripts/test-env.sh builds: one multi-call program linked under each component's name,
each name answering as that component's own binary does (its version, its exit codes), and runc and the CNI
plugins static at the versions pinned in scripts/versions.env."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.components import SETUP_HINT, cache_dir

REPO = Path(__file__).resolve().parents[2]
MULTICALL = "dsnap-multicall"
NAMES = (
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy", "etcd",
    "containerd", "containerd-shim-runc-v2", "ctr", "gpu-device-plugin",
)  # fmt: skip


def _pin(name: str) -> str:
    found = re.search(rf"^{name}=(\S+)", (REPO / "scripts" / "versions.env").read_text(), re.MULTILINE)
    assert found, f"scripts/versions.env pins no {name}"
    return found.group(1)


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    base = cache_dir() / "bin"
    if not (base / MULTICALL).is_file():
        pytest.fail(f"no {base / MULTICALL}: {SETUP_HINT}", pytrace=False)
    return base


def _run(argv: list[str | Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60, check=False)


def test_every_name_is_a_link_to_the_one_program(bin_dir: Path) -> None:
    for name in NAMES:
        link = bin_dir / name
        assert link.is_symlink(), f"{link} is not a link"
        assert link.readlink() == Path(MULTICALL), f"{link} is not a link to {MULTICALL}"


def test_each_name_reports_its_pinned_version(bin_dir: Path) -> None:
    k8s, containerd = _pin("K8S_VERSION"), _pin("CONTAINERD_VERSION")
    for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"):
        assert _run([bin_dir / name, "--version"]).stdout.strip() == f"Kubernetes {k8s}", name
    assert f"Client Version: {k8s}" in _run([bin_dir / "kubectl", "version", "--client"]).stdout
    assert (
        _run([bin_dir / "etcd", "--version"]).stdout.splitlines()[0]
        == f"etcd Version: {_pin('ETCD_VERSION')[1:]}"
    )
    for name in ("containerd", "ctr"):
        assert f" {containerd}" in _run([bin_dir / name, "--version"]).stdout, name
    assert f"Version:  {containerd}" in _run([bin_dir / "containerd-shim-runc-v2", "-v"]).stdout


def test_exit_codes_are_the_components_own(bin_dir: Path) -> None:
    for name in ("kube-apiserver", "kubelet", "kubectl", "containerd", "ctr"):
        assert _run([bin_dir / name, "--no-such-flag"]).returncode == 1, name
    assert _run([bin_dir / "etcd", "--no-such-flag"]).returncode == 2
    assert _run([bin_dir / "gpu-device-plugin", "--device", "not-a-pair"]).returncode == 2


def test_the_program_under_its_own_name_takes_the_component_as_first_argument(bin_dir: Path) -> None:
    proc = _run([bin_dir / MULTICALL, "kubelet", "--version"])
    assert (proc.returncode, proc.stdout.strip()) == (0, f"Kubernetes {_pin('K8S_VERSION')}")
    proc = _run([bin_dir / MULTICALL, "kube-nothing"])
    assert proc.returncode == 2
    assert 'unknown command "kube-nothing"' in proc.stderr
    assert "kube-apiserver" in proc.stderr, "the message lists the components"


def _elf_interpreter(path: Path) -> bool:
    """Whether the ELF file asks for a dynamic loader (a PT_INTERP program header)."""
    data = path.read_bytes()
    phoff, phentsize, phnum = (
        int.from_bytes(data[0x20:0x28], "little"),
        int.from_bytes(data[0x36:0x38], "little"),
        int.from_bytes(data[0x38:0x3A], "little"),
    )
    types = [
        int.from_bytes(data[phoff + i * phentsize : phoff + i * phentsize + 4], "little")
        for i in range(phnum)
    ]
    return 3 in types  # PT_INTERP


def test_runc_and_the_cni_plugins_are_static_at_their_pins(bin_dir: Path) -> None:
    runc = bin_dir / "runc"
    lines = _run([runc, "--version"]).stdout.splitlines()
    assert lines[0] == f"runc version {_pin('RUNC_VERSION')[1:]}"
    assert any(line.startswith("libseccomp: ") for line in lines), "runc built without seccomp"
    cni = _pin("CNI_PLUGINS_VERSION")
    for path in (runc, *(bin_dir / "cni" / p for p in ("bridge", "host-local", "loopback"))):
        assert not _elf_interpreter(path), f"{path} needs a dynamic loader"
    for plugin in ("bridge", "host-local", "loopback"):
        # Run with no CNI_COMMAND, a plugin names itself and its version.
        proc = subprocess.run([bin_dir / "cni" / plugin], env={}, capture_output=True, text=True, check=False)
        assert f"CNI {plugin} plugin {cni}" in proc.stderr, plugin
