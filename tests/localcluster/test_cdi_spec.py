"""The CDI spec of a GPU node, made from the machine's facts without a GPU: the spec for an H200 machine as
benchmarks/results/gpu-node-facts-h200.txt records it (written out by hand below), a two-GPU machine whose
device minors are not its indexes, the refusals, and the readers of nvidia-smi, /proc and ldconfig."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dynamo_snapshot_dev.localcluster.realnode.cdi import (
    CdiSpecError,
    DeviceNode,
    Gpu,
    GpuFacts,
    cdi_spec,
    driver_library_files,
    gather_facts,
    naming_a_missing_device_node,
    parse_ldconfig,
    parse_smi_gpus,
    proc_device_minor,
    read_device_nodes,
    spec_device_nodes,
    write_cdi_spec,
)

H200_UUID = "GPU-de4bc798-4095-f0b7-1d1d-b727ab7f0dc1"
LIB = Path("/usr/local/nvidia/lib64")
H200_LIBS = [
    LIB / n
    for n in (
        "libcuda.so",
        "libcuda.so.1",
        "libcuda.so.580.159.04",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so.580.159.04",
        "libnvidia-ptxjitcompiler.so.1",
    )
]
H200 = GpuFacts(
    gpus=[Gpu(index=0, uuid=H200_UUID, name="NVIDIA H200", minor=0)],
    device_nodes={
        "nvidia0": DeviceNode(major=195, minor=0),
        "nvidiactl": DeviceNode(major=195, minor=255),
        "nvidia-uvm": DeviceNode(major=238, minor=0),
        "nvidia-uvm-tools": DeviceNode(major=238, minor=1),
    },
    libraries=H200_LIBS,
    binaries=[Path("/usr/bin/nvidia-smi")],
)
RO = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
H200_SPEC = {
    "cdiVersion": "0.6.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {
            "name": "0",
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]},
        },
        {
            "name": H200_UUID,
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]},
        },
    ],
    "containerEdits": {
        "env": ["LD_LIBRARY_PATH=/usr/local/nvidia/lib64"],
        "deviceNodes": [
            {"path": "/dev/nvidiactl", "hostPath": "/dev/nvidiactl"},
            {"path": "/dev/nvidia-uvm", "hostPath": "/dev/nvidia-uvm"},
            {"path": "/dev/nvidia-uvm-tools", "hostPath": "/dev/nvidia-uvm-tools"},
        ],
        "mounts": [
            {"hostPath": "/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi", "options": RO},
            {"hostPath": f"{LIB}/libcuda.so", "containerPath": f"{LIB}/libcuda.so", "options": RO},
            {"hostPath": f"{LIB}/libcuda.so.1", "containerPath": f"{LIB}/libcuda.so.1", "options": RO},
            {
                "hostPath": f"{LIB}/libcuda.so.580.159.04",
                "containerPath": f"{LIB}/libcuda.so.580.159.04",
                "options": RO,
            },
            {
                "hostPath": f"{LIB}/libnvidia-ml.so.1",
                "containerPath": f"{LIB}/libnvidia-ml.so.1",
                "options": RO,
            },
            {
                "hostPath": f"{LIB}/libnvidia-ml.so.580.159.04",
                "containerPath": f"{LIB}/libnvidia-ml.so.580.159.04",
                "options": RO,
            },
            {
                "hostPath": f"{LIB}/libnvidia-ptxjitcompiler.so.1",
                "containerPath": f"{LIB}/libnvidia-ptxjitcompiler.so.1",
                "options": RO,
            },
        ],
    },
}


def test_the_h200_machines_spec() -> None:
    assert cdi_spec(H200) == H200_SPEC


def test_each_gpu_by_index_and_uuid_with_its_own_minor() -> None:
    nodes = {f"nvidia{m}": DeviceNode(major=195, minor=m) for m in (0, 1, 2, 3)}
    nodes |= {"nvidiactl": DeviceNode(major=195, minor=255), "nvidia-uvm": DeviceNode(major=238, minor=0)}
    facts = H200.model_copy(
        update={
            "gpus": [
                Gpu(index=1, uuid="GPU-1111", name="NVIDIA H100", minor=3),
                Gpu(index=0, uuid="GPU-0000", name="NVIDIA H100", minor=2),
            ],
            "device_nodes": nodes,
            "dev_dir": Path("/run/fake/dev"),
        }
    )
    spec = cdi_spec(facts)
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert list(by_name) == ["0", "GPU-0000", "1", "GPU-1111"]
    assert (
        by_name["1"] == by_name["GPU-1111"] == [{"path": "/dev/nvidia3", "hostPath": "/run/fake/dev/nvidia3"}]
    )
    assert by_name["0"] == [{"path": "/dev/nvidia2", "hostPath": "/run/fake/dev/nvidia2"}]
    controls = [n["path"] for n in spec["containerEdits"]["deviceNodes"]]
    assert controls == ["/dev/nvidiactl", "/dev/nvidia-uvm"], "nvidia-uvm-tools only where the machine has it"


@pytest.mark.parametrize(
    ("absent", "named"),
    [("nvidia0", "/dev/nvidia0"), ("nvidiactl", "/dev/nvidiactl"), ("nvidia-uvm", "/dev/nvidia-uvm")],
)
def test_a_spec_naming_a_missing_device_node_is_refused(absent: str, named: str) -> None:
    nodes = {k: v for k, v in H200.device_nodes.items() if k != absent}
    with pytest.raises(CdiSpecError, match=f"would name {named}, which is not a character device"):
        cdi_spec(H200.model_copy(update={"device_nodes": nodes}))


def test_no_gpu_or_no_libcuda_is_refused() -> None:
    with pytest.raises(CdiSpecError, match="no NVIDIA GPU"):
        cdi_spec(H200.model_copy(update={"gpus": []}))
    libs = [p for p in H200_LIBS if not p.name.startswith("libcuda")]
    with pytest.raises(CdiSpecError, match=r"no libcuda\.so"):
        cdi_spec(H200.model_copy(update={"libraries": libs}))


def _fake_dev(tmp_path: Path, names: list[str]) -> Path:
    """Device nodes without root: links to /dev/null, a character device (the node is stat()ed through)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in names:
        (dev / n).symlink_to("/dev/null")
    (dev / "nvidia-caps").mkdir()
    (dev / "nvidia-fake-file").touch()
    return dev


def test_written_spec_is_the_spec_and_names_present_nodes(tmp_path: Path) -> None:
    dev = _fake_dev(tmp_path, ["nvidia0", "nvidiactl", "nvidia-uvm"])
    found = read_device_nodes(dev)
    null = os.stat("/dev/null").st_rdev
    assert found == {
        n: DeviceNode(major=os.major(null), minor=os.minor(null))
        for n in ("nvidia0", "nvidiactl", "nvidia-uvm")
    }
    facts = H200.model_copy(update={"dev_dir": dev, "device_nodes": found})
    path = write_cdi_spec(tmp_path / "cdi", facts)
    spec = json.loads(path.read_text())
    assert spec == cdi_spec(facts)
    assert sorted(spec_device_nodes(spec)) == sorted(
        [dev / "nvidia0", dev / "nvidia0", dev / "nvidiactl", dev / "nvidia-uvm"]
    )
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"


def test_write_refuses_a_node_gone_since_the_facts_were_read(tmp_path: Path) -> None:
    dev = _fake_dev(tmp_path, ["nvidia0", "nvidiactl", "nvidia-uvm"])
    facts = H200.model_copy(update={"dev_dir": dev, "device_nodes": read_device_nodes(dev)})
    (dev / "nvidia0").unlink()
    with pytest.raises(CdiSpecError, match=f"names missing device nodes: {dev / 'nvidia0'}"):
        write_cdi_spec(tmp_path / "cdi", facts)
    assert not (tmp_path / "cdi").exists()


def test_the_fault_of_a_spec_naming_a_missing_node_touches_one_device_only() -> None:
    missing = Path("/dev/nvidia-gone")
    faulty = naming_a_missing_device_node(H200_SPEC, H200_UUID, missing)
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in faulty["devices"]}
    assert by_name[H200_UUID][-1] == {"path": str(missing), "hostPath": str(missing)}
    assert (
        by_name["0"]
        == next(d for d in H200_SPEC["devices"] if d["name"] == "0")["containerEdits"]["deviceNodes"]
    ), "the index's entry is left as it was"
    assert missing in spec_device_nodes(faulty)
    assert missing not in spec_device_nodes(H200_SPEC), "the spec given is not changed"
    with pytest.raises(CdiSpecError, match="has no device 'GPU-nope'"):
        naming_a_missing_device_node(H200_SPEC, "GPU-nope", missing)


def test_smi_lines_and_the_drivers_device_minor(tmp_path: Path) -> None:
    info = tmp_path / "0000:00:06.0" / "information"
    info.parent.mkdir()
    info.write_text(
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 31\nDevice Minor: \t 7\nBus Location: \t 0000:00:06.0\n"
    )
    csv = f"0, {H200_UUID}, NVIDIA H200, 00000000:00:06.0\n1, GPU-2222, NVIDIA H200, 00000000:00:07.0\n"
    gpus = parse_smi_gpus(csv, lambda bus: proc_device_minor(bus, tmp_path))
    assert gpus == [
        Gpu(index=0, uuid=H200_UUID, name="NVIDIA H200", minor=7),
        Gpu(index=1, uuid="GPU-2222", name="NVIDIA H200", minor=1),  # no /proc entry: the index
    ]
    with pytest.raises(CdiSpecError, match="not index, uuid, name, bus id"):
        parse_smi_gpus("No devices were found\n", lambda bus: None)


def test_ldconfig_first_path_wins_and_driver_files_are_picked_by_name() -> None:
    out = (
        "1234 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibcuda.so.1 (libc6,x86-64) => /usr/local/nvidia/lib64/libcuda.so.1\n"
        "\tlibcuda.so.1 (libc6,x86-64) => /lib/libcuda.so.1\n"
        "\tlibnvrtc.so.13 (libc6,x86-64) => /usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.13\n"
    )
    found = parse_ldconfig(out)
    assert found["libcuda.so.1"] == Path("/usr/local/nvidia/lib64/libcuda.so.1")
    names = [
        "libcuda.so.1",
        "libcuda.so.580.159.04",
        "libnvidia-glcore.so.580.159.04",
        "libcudart.so.13",
        "libnvidia-ml.so",
        "libnvidia-nvvm.so.4",
        "libnvidia-pkcs11-openssl3.so.580.159.04",
        "libcuda.sox",
    ]
    assert [p.name for p in driver_library_files(LIB, names)] == [
        "libcuda.so.1",
        "libcuda.so.580.159.04",
        "libnvidia-ml.so",
        "libnvidia-nvvm.so.4",
        "libnvidia-pkcs11-openssl3.so.580.159.04",
    ]


def test_gather_reads_the_machine_through_its_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir, lib = tmp_path / "bin", tmp_path / "lib64"
    bindir.mkdir()
    lib.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(stat.S_IRWXU)
    for name in ("libcuda.so.580.1", "libnvidia-ml.so.580.1", "libnvidia-glcore.so.580.1"):
        (lib / name).write_text("elf")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    monkeypatch.setenv("PATH", str(bindir))
    dev = _fake_dev(tmp_path, ["nvidia0", "nvidiactl", "nvidia-uvm"])
    outputs = {
        "nvidia-smi": f"0, {H200_UUID}, NVIDIA H200, 00000000:00:06.0\n",
        "ldconfig": f"3 libs found\n\tlibcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1\n",
    }
    facts = gather_facts(dev, run=lambda argv: outputs[Path(argv[0]).name])
    assert facts.gpus == [Gpu(index=0, uuid=H200_UUID, name="NVIDIA H200", minor=0)]
    assert facts.libraries == [lib / "libcuda.so.1", lib / "libcuda.so.580.1", lib / "libnvidia-ml.so.580.1"]
    assert facts.binaries == [smi]
    assert sorted(facts.device_nodes) == ["nvidia-uvm", "nvidia0", "nvidiactl"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CdiSpecError, match="nvidia-smi is not on PATH"):
        gather_facts(dev, run=lambda argv: outputs[Path(argv[0]).name])
