"""The CDI spec of the machine's NVIDIA GPUs, as NVIDIA's container toolkit (`nvidia-ctk cdi generate`)
makes one: kind `nvidia.com/gpu`, one device per GPU under its index and under its UUID (its
/dev/nvidia<minor>), and edits common to them all: the control device nodes, the driver's libraries and
nvidia-smi bind-mounted read-only at their host paths, and LD_LIBRARY_PATH naming the libraries' directory.

containerd 2.2 (its CDI library, tags.cncf.io/container-device-interface v1.1.0) reads specs of cdiVersion
0.3.0 to 1.1.0; the spec says 0.6.0, which covers everything it uses (device names that start with a digit
and device nodes with a host path need 0.5.0).

No ldcache hook: the toolkit runs `nvidia-cdi-hook update-ldcache` in the container to add the mounted
libraries to its ld.so.cache; with no hook binary on the node, LD_LIBRARY_PATH does the same for every
process of the container (it replaces an LD_LIBRARY_PATH the image sets).

`gather_facts` reads the machine (nvidia-smi, /proc/driver/nvidia, `ldconfig -p`, the device nodes);
`cdi_spec` is a pure function of those facts, so it is tested without a GPU; `write_cdi_spec` puts the
spec where containerd's cdi_spec_dirs look, after checking that every device node it names is there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

CDI_VERSION = "0.6.0"
CDI_KIND = "nvidia.com/gpu"
SPEC_NAME = "dynamo-snapshot-nvidia.json"
# The driver's user-space libraries a CUDA container needs (the toolkit's "compute" and "utility"
# capabilities, its default): every file in the driver's library directory named <one of these>[.N...].
DRIVER_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-opencl.so",
    "libnvidia-allocator.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
)
DRIVER_BINARIES = ("nvidia-smi",)
# nvidiactl and nvidia-uvm are needed by every CUDA process; nvidia-uvm-tools only by profilers, and the
# driver makes it only with nvidia-uvm loaded a certain way: named where present, as the toolkit does.
REQUIRED_CONTROL_NODES = ("nvidiactl", "nvidia-uvm")
OPTIONAL_CONTROL_NODES = ("nvidia-uvm-tools",)
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
CONTAINER_DEV = Path("/dev")
_SMI_QUERY = ("--query-gpu=index,uuid,name,pci.bus_id", "--format=csv,noheader")
_MINOR_LINE = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.MULTILINE)


class CdiSpecError(RuntimeError):
    """The spec cannot be made or written; the message says what is missing on the machine."""


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0)
    uuid: str = Field(pattern=r"^GPU-[0-9a-fA-F-]+$")
    name: str
    # The minor number of its /dev/nvidia<minor> (the driver's, which need not be the index).
    minor: int = Field(ge=0, le=254)


class DeviceNode(BaseModel):
    model_config = ConfigDict(frozen=True)

    major: int
    minor: int


class GpuFacts(BaseModel):
    """What the spec is made from, read off the machine by `gather_facts` (or written by a test)."""

    model_config = ConfigDict(frozen=True)

    gpus: list[Gpu]
    # Where the NVIDIA device nodes are on the host; containers see them under /dev.
    dev_dir: Path = Path("/dev")
    # The character devices found in `dev_dir`, by file name (nvidia0, nvidiactl, ...).
    device_nodes: dict[str, DeviceNode]
    # Host paths of the driver's libraries (files and their soname links) and binaries to mount.
    libraries: list[Path]
    binaries: list[Path] = []


def cdi_spec(facts: GpuFacts) -> dict[str, Any]:
    """The CDI spec for ``facts``; refused (CdiSpecError) when it would name a device node the machine
    does not have, or has no GPU or no driver library to give."""
    if not facts.gpus:
        raise CdiSpecError(
            "no NVIDIA GPU on this machine: nvidia-smi lists none, so there is nothing to give pods"
        )
    missing = [n for n in REQUIRED_CONTROL_NODES if n not in facts.device_nodes]
    missing += [f"nvidia{g.minor}" for g in facts.gpus if f"nvidia{g.minor}" not in facts.device_nodes]
    if missing:
        names = ", ".join(str(facts.dev_dir / n) for n in missing)
        raise CdiSpecError(
            f"the CDI spec would name {names}, which {'is' if len(missing) == 1 else 'are'} not a character "
            "device on this machine: is the NVIDIA driver loaded (nvidia-modprobe / nvidia-smi makes them)?"
        )
    if not any(p.name.startswith("libcuda.so") for p in facts.libraries):
        raise CdiSpecError("no libcuda.so among the driver's libraries: is the NVIDIA driver installed?")
    devices = []
    for gpu in sorted(facts.gpus, key=lambda g: g.index):
        edits = {"deviceNodes": [_device_node(facts, f"nvidia{gpu.minor}")]}
        devices += [
            {"name": str(gpu.index), "containerEdits": edits},
            {"name": gpu.uuid, "containerEdits": edits},
        ]
    controls = [*REQUIRED_CONTROL_NODES, *(n for n in OPTIONAL_CONTROL_NODES if n in facts.device_nodes)]
    mounts = [_mount(p) for p in sorted({*facts.libraries, *facts.binaries})]
    lib_dirs = sorted({str(p.parent) for p in facts.libraries})
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": devices,
        "containerEdits": {
            "env": [f"LD_LIBRARY_PATH={':'.join(lib_dirs)}"],
            "deviceNodes": [_device_node(facts, n) for n in controls],
            "mounts": mounts,
        },
    }


def _device_node(facts: GpuFacts, name: str) -> dict[str, str]:
    # Path and host path only: the runtime reads type, major and minor off the host's node when it injects
    # it, so a node gone since the spec was written fails the container instead of naming a stale device.
    return {"path": str(CONTAINER_DEV / name), "hostPath": str(facts.dev_dir / name)}


def _mount(path: Path) -> dict[str, Any]:
    return {"hostPath": str(path), "containerPath": str(path), "options": list(MOUNT_OPTIONS)}


def spec_device_nodes(spec: Mapping[str, Any]) -> list[Path]:
    """Every host device node a spec names (its devices' and its common edits')."""
    edits = [spec.get("containerEdits") or {}, *((d.get("containerEdits") or {}) for d in spec["devices"])]
    return [Path(n.get("hostPath") or n["path"]) for e in edits for n in e.get("deviceNodes") or []]


def naming_a_missing_device_node(spec: Mapping[str, Any], device: str, host_path: Path) -> dict[str, Any]:
    """``spec`` with ``host_path`` added to the device nodes of its device ``device`` (a GPU's UUID or
    index): the spec a mis-edit or a driver reload leaves behind, naming a node the machine lacks. A fault
    for tests; `write_cdi_spec` never writes such a spec."""
    names = [d["name"] for d in spec["devices"]]
    if device not in names:
        raise CdiSpecError(f"the CDI spec has no device {device!r} (it has {', '.join(names)})")
    out: dict[str, Any] = json.loads(json.dumps(spec))
    for d in out["devices"]:
        if d["name"] == device:
            edits = d.setdefault("containerEdits", {})
            edits.setdefault("deviceNodes", []).append({"path": str(host_path), "hostPath": str(host_path)})
    return out


def replace_spec_file(path: Path, spec: Mapping[str, Any]) -> None:
    """Write ``spec`` to ``path`` whole or not at all: containerd and the device plugin read the directory
    at any moment."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(spec, indent=2) + "\n")
    os.replace(tmp, path)


def write_cdi_spec(directory: Path, facts: GpuFacts | None = None) -> Path:
    """Write the machine's spec (from ``facts``, else `gather_facts`) as ``directory``/SPEC_NAME, whole or
    not at all; refused when a device node it names is not a character device now."""
    spec = cdi_spec(facts or gather_facts())
    absent = [str(p) for p in spec_device_nodes(spec) if not _is_char_device(p)]
    if absent:
        raise CdiSpecError(
            f"refusing to write a CDI spec that names missing device nodes: {', '.join(absent)}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SPEC_NAME
    replace_spec_file(path, spec)
    return path


# ---------------------------------------------------------------------------------------- the machine
def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False


def read_device_nodes(dev_dir: Path) -> dict[str, DeviceNode]:
    """The NVIDIA character devices in ``dev_dir`` (nvidia*, not the nvidia-caps directory)."""
    found = {}
    for entry in sorted(dev_dir.glob("nvidia*")):
        try:
            st = entry.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found[entry.name] = DeviceNode(major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))
    return found


def parse_smi_gpus(csv: str, minor_of: Callable[[str], int | None]) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,name,pci.bus_id --format=csv,noheader``; the device
    minor from ``minor_of(bus id)`` (the driver's /proc file), else the index."""
    gpus = []
    for line in csv.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            raise CdiSpecError(f"nvidia-smi printed a line that is not index, uuid, name, bus id: {line!r}")
        index, uuid, name, bus = int(fields[0]), fields[1], fields[2], fields[3]
        minor = minor_of(bus)
        gpus.append(Gpu(index=index, uuid=uuid, name=name, minor=index if minor is None else minor))
    return gpus


def proc_device_minor(bus_id: str, proc: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The device minor the driver reports for the GPU at ``bus_id`` (nvidia-smi's 8-digit domain form)."""
    domain, _, rest = bus_id.lower().partition(":")
    info = proc / f"{domain[-4:]}:{rest}" / "information"
    try:
        found = _MINOR_LINE.search(info.read_text())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def parse_ldconfig(output: str) -> dict[str, Path]:
    """``ldconfig -p``'s libraries, the first path for each name (the order the loader searches)."""
    found: dict[str, Path] = {}
    for line in output.splitlines()[1:]:
        name, sep, path = line.strip().partition(" => ")
        if sep:
            found.setdefault(name.split(" ", 1)[0], Path(path.strip()))
    return found


def driver_library_files(lib_dir: Path, names: Iterable[str]) -> list[Path]:
    """The driver libraries among ``names`` (file names in ``lib_dir``): each DRIVER_LIBRARIES entry and
    its versioned names (libcuda.so, libcuda.so.1, libcuda.so.580.159.04)."""
    wanted = [n for n in names if any(n == lib or n.startswith(lib + ".") for lib in DRIVER_LIBRARIES)]
    return [lib_dir / n for n in sorted(wanted)]


def gather_facts(dev_dir: Path = Path("/dev"), run: Callable[[list[str]], str] | None = None) -> GpuFacts:
    """The machine's GPUs, device nodes, driver libraries (the directory libcuda.so.1 resolves into, as
    `ldconfig -p` finds it) and nvidia-smi."""
    run = run or _run
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise CdiSpecError("nvidia-smi is not on PATH: the NVIDIA driver's tools are needed to list the GPUs")
    gpus = parse_smi_gpus(run([smi, *_SMI_QUERY]), proc_device_minor)
    libcuda = parse_ldconfig(run(["ldconfig", "-p"])).get("libcuda.so.1")
    if libcuda is None:
        raise CdiSpecError(
            "ldconfig -p lists no libcuda.so.1: is the NVIDIA driver's library directory known to ldconfig?"
        )
    lib_dir = libcuda.resolve().parent
    libraries = driver_library_files(lib_dir, (p.name for p in lib_dir.iterdir()))
    return GpuFacts(
        gpus=gpus,
        dev_dir=dev_dir,
        device_nodes=read_device_nodes(dev_dir),
        libraries=libraries,
        binaries=[Path(smi)],
    )


def _run(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CdiSpecError(f"{' '.join(argv)}: {e}") from None
    if proc.returncode != 0:
        raise CdiSpecError(f"{' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout
