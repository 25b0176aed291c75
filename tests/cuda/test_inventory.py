"""The GPU inventory's shaping of NVML answers, against a stand-in pynvml."""

from __future__ import annotations

import dataclasses

import pytest

from dynamo_snapshot.cuda import (
    NodeGpus,
    NvmlUnavailableError,
    driver_info,
    gpu_memory_by_pid,
    list_gpus,
    node_gpus,
)
from tests.cuda.fakes import FakeNvml

U0 = "GPU-00000000-0000-0000-0000-000000000000"
U1 = "GPU-11111111-1111-1111-1111-111111111111"
U2 = "GPU-22222222-2222-2222-2222-222222222222"


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml(
        [
            (b"NVIDIA H200", U0, 143771, 143000),
            ("NVIDIA H200", U1, 143771, 100),
            ("NVIDIA H200", U2, 143770, 5),
        ],
        procs={0: [(4242, 1024), (7, None)], 2: [(4242, 10)]},
    )


def test_driver_info_separates_driver_and_cuda_majors(nvml: FakeNvml) -> None:
    info = driver_info(nvml)
    assert (info.driver_version, info.driver_major, info.cuda_version, info.cuda_major) == (
        "580.159.04",
        "580",
        13000,
        "13",
    )
    assert nvml.open == 0  # every call shuts NVML down again


def test_list_gpus(nvml: FakeNvml) -> None:
    gpus = list_gpus(nvml)
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0].name == "NVIDIA H200"  # bytes from old nvidia-ml-py decoded
    assert gpus[0].product == "NVIDIA-H200"
    assert (gpus[1].uuid, gpus[1].memory_total_mib, gpus[1].memory_free_mib) == (U1, 143771, 100)


def test_node_gpus_all_and_selected(nvml: FakeNvml) -> None:
    everything = node_gpus(nvml=nvml)
    assert everything == NodeGpus("NVIDIA-H200", "580.159.04", "580", 3, (U0, U1, U2), 143770)
    # The manifest's GPU record takes exactly these fields.
    assert set(dataclasses.asdict(everything)) == {
        "product",
        "driver_version",
        "cuda_driver_major",
        "count",
        "uuids",
        "memory_mib",
    }
    picked = node_gpus([U2.upper(), U1.removeprefix("GPU-")], nvml=nvml)
    assert (picked.count, picked.uuids, picked.memory_mib) == (2, (U1, U2), 143770)


def test_node_gpus_unknown_uuid(nvml: FakeNvml) -> None:
    with pytest.raises(ValueError, match="no GPU with UUID GPU-33333333"):
        node_gpus(["GPU-33333333-3333-3333-3333-333333333333"], nvml=nvml)


def test_no_gpus_is_unavailable() -> None:
    with pytest.raises(NvmlUnavailableError, match="no GPU"):
        node_gpus(nvml=FakeNvml([]))


def test_nvml_init_failure_says_no_driver() -> None:
    broken = FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    with pytest.raises(
        NvmlUnavailableError, match="no NVIDIA driver: nvmlInit failed with NVML Shared Library"
    ):
        driver_info(broken)


def test_gpu_memory_by_pid_sums_over_gpus(nvml: FakeNvml) -> None:
    assert gpu_memory_by_pid(nvml) == {4242: 1034, 7: 0}
