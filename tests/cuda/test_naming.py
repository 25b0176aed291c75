"""GPU UUID spelling and GPU feature discovery's names for products and versions."""

from __future__ import annotations

import pytest

from dynamo_snapshot.cuda import format_gpu_uuid, gfd_product, parse_gpu_uuid
from dynamo_snapshot.cuda.inventory import cuda_major, driver_major

UUID = "GPU-5f3c0e5e-1c2d-3e4f-5a6b-7c8d9e0f1a2b"
RAW = bytes.fromhex("5f3c0e5e1c2d3e4f5a6b7c8d9e0f1a2b")


@pytest.mark.parametrize(
    "text",
    [
        UUID,
        UUID.upper(),
        UUID.removeprefix("GPU-"),
        "5f3c0e5e1c2d3e4f5a6b7c8d9e0f1a2b",
        f"  {UUID}\n",
        "gpu-" + UUID[4:],
    ],
)
def test_parse_gpu_uuid_spellings(text: str) -> None:
    assert parse_gpu_uuid(text) == RAW


@pytest.mark.parametrize(
    "text",
    ["", "GPU-", "GPU-5f3c0e5e", UUID + "00", UUID.replace("5f", "zz"), "MIG-" + UUID[4:], "GPU-" + UUID],
)
def test_parse_gpu_uuid_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a GPU UUID"):
        parse_gpu_uuid(text)


def test_format_gpu_uuid_round_trips_in_nvml_spelling() -> None:
    assert format_gpu_uuid(RAW) == UUID
    assert format_gpu_uuid(parse_gpu_uuid(UUID.upper())) == UUID
    with pytest.raises(ValueError, match="16 bytes"):
        format_gpu_uuid(RAW[:15])


@pytest.mark.parametrize(
    ("name", "product"),
    [
        ("NVIDIA H200", "NVIDIA-H200"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("Tesla T4", "Tesla-T4"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA-GeForce-RTX-4090"),
    ],
)
def test_gfd_product(name: str, product: str) -> None:
    assert gfd_product(name) == product


@pytest.mark.parametrize(
    ("version", "major"), [("580.159.04", "580"), ("570.86", "570"), (" 550.54.15\n", "550")]
)
def test_driver_major_is_the_kernel_driver_major(version: str, major: str) -> None:
    assert driver_major(version) == major


@pytest.mark.parametrize("version", ["580", "580.1.2.3", "abc.1", ""])
def test_driver_major_rejects(version: str) -> None:
    with pytest.raises(ValueError, match=r"X\.Y"):
        driver_major(version)


@pytest.mark.parametrize(("version", "major"), [(13000, "13"), (12080, "12"), (12040, "12"), (11080, "11")])
def test_cuda_major(version: int, major: str) -> None:
    assert cuda_major(version) == major
