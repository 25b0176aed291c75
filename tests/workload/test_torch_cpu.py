"""The torch side of VmmRegion, KvCache and WeightRegion (views, pack, the pinned-buffer transfer engine,
pack_module) with real torch tensors, where "device memory" is host memory and torch.cuda is stubbed.

Plumbing only: the region's addresses are host memory behind a pure-Python driver stand-in, views are
CPU tensors over them, and copies are synchronous. It runs wherever torch is installed (skipped
otherwise); what only a GPU can show is in tests/gpu/vmm_scenarios.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_snapshot.workload import gpu_memory, kv_cache, weights
from dynamo_snapshot.workload.gpu_memory import RegionPool, VmmRegion
from dynamo_snapshot.workload.kv_cache import KvCache
from dynamo_snapshot.workload.weights import WeightRegion, pack_module
from tests.workload.fake_cuda import GARBAGE, FakeDriver

torch = pytest.importorskip("torch")


class HostBackedDriver(FakeDriver):
    """FakeDriver whose reserved addresses are real host memory: torch can view them. Unmapping
    scribbles over the range, so only a real reload brings the bytes back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._maps: list[mmap.mmap] = []

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[Any, Any]:
        err, ptr = super().cuMemAddressReserve(size, alignment, addr, flags)
        if ptr is None:
            return err, None
        del self.reservations[int(ptr)]
        mm = mmap.mmap(-1, size + alignment)
        anchor = ctypes.c_char.from_buffer(mm)
        base = ctypes.addressof(anchor)
        del anchor
        self._maps.append(mm)  # never unmapped: views may outlive the test's region
        real = -(-base // alignment) * alignment
        self.reservations[real] = size
        return err, real

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[Any]:
        out = super().cuMemUnmap(ptr, size)
        ctypes.memset(int(ptr), GARBAGE, size)
        return out


class _Event:
    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuTorch:
    """torch, with "cuda" devices mapped to the CPU and torch.cuda's stream machinery as no-ops."""

    def __init__(self) -> None:
        self.cuda = SimpleNamespace(
            device=lambda d: contextlib.nullcontext(),
            stream=lambda s: contextlib.nullcontext(),
            synchronize=lambda d=None: None,
            empty_cache=lambda: None,
            Stream=lambda device=None: SimpleNamespace(synchronize=lambda: None),
            Event=_Event,
        )

    def device(self, kind: str, index: int | None = None) -> Any:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@pytest.fixture
def cu(monkeypatch: pytest.MonkeyPatch) -> HostBackedDriver:
    fake = CpuTorch()
    for module in (gpu_memory, kv_cache, weights):
        monkeypatch.setattr(module, "_import_torch", lambda: fake)
    driver = HostBackedDriver(granularity=64 << 10, total=256 << 20)
    driver.set_current_for_test(FakeDriver.context_of(0))
    return driver


def test_views_alias_the_region_with_any_dtype(cu: HostBackedDriver) -> None:
    region = VmmRegion(1 << 20, 0, driver=cu)
    t = region.as_tensor(torch.bfloat16, (4, 8), offset=512)
    assert t.dtype == torch.bfloat16
    assert t.shape == (4, 8)
    assert t.is_contiguous()
    assert t.data_ptr() == region.ptr + 512
    # On a machine without CUDA torch refuses the array interface: the storage pointer is the way.
    assert region.tensor_path == "storage_pointer"
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        region.as_tensor(torch.uint8, (1,), via="cuda_array_interface")
    t.fill_(1.5)
    same_memory = region.as_tensor(torch.int16, (32,), offset=512)
    assert set(same_memory.tolist()) == {int(torch.tensor(1.5, dtype=torch.bfloat16).view(torch.int16))}
    assert region.as_tensor(torch.float8_e4m3fn, (3,), offset=3).element_size() == 1
    assert region.as_tensor(torch.float32, ()).shape == ()
    with pytest.raises(ValueError, match="multiple"):
        region.as_tensor(torch.float32, (1,), offset=2)
    with pytest.raises(ValueError, match="fit"):
        region.as_tensor(torch.uint8, (region.size + 1,))


def test_kv_cache_allocates_aligned_tensors(cu: HostBackedDriver) -> None:
    kv = KvCache(1 << 20, driver=cu, pool=RegionPool())
    k = kv.allocate("k", (3, 5), torch.float16)
    v = kv.allocate("v", (7,), torch.float32, alignment=4096)
    assert k.data_ptr() == kv.region.ptr
    assert v.data_ptr() == kv.region.ptr + 4096
    assert kv.used_bytes == 4096 + 28
    assert set(kv.tensors) == {"k", "v"}
    with pytest.raises(ValueError, match="exists"):
        kv.allocate("k", (1,), torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        kv.allocate("huge", (kv.free_bytes + 1,), torch.uint8)
    v.fill_(3.0)
    kv.release_for_checkpoint()
    kv.reacquire_after_restore()
    assert v.data_ptr() == kv.region.ptr + 4096  # same address; contents undefined
    kv.reacquire_after_restore(zero=False)


def named_tensors() -> list[tuple[str, Any]]:
    gen = torch.Generator().manual_seed(5)
    return [
        ("emb", torch.randn(33, 17, generator=gen).to(torch.bfloat16)),
        ("odd", torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=gen)),
        ("fp8", torch.randn(300, generator=gen).to(torch.float8_e4m3fn)),
        ("strided", torch.randn(64, 48, generator=gen).t()),
        ("param", torch.nn.Parameter(torch.randn(8, 8, generator=gen))),
        ("empty", torch.empty(0, 3)),
        ("flag", torch.tensor(True)),
    ]


def same_bytes(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("direct", [None, True, False])
def test_pack_save_release_load_with_the_torch_engine(
    cu: HostBackedDriver, tmp_path: Path, direct: bool | None
) -> None:
    named = named_tensors()
    region = WeightRegion(driver=cu, pool=RegionPool())
    views = region.pack(named)
    assert region.region is not None
    for spec in region.specs:
        assert views[spec.name].data_ptr() == region.region.ptr + spec.offset or spec.nbytes == 0
        assert views[spec.name].dtype == dict(named)[spec.name].dtype
        assert same_bytes(views[spec.name], dict(named)[spec.name].detach())
    assert not views["param"].requires_grad
    dtypes = [s.dtype for s in region.specs]
    assert dtypes == ["bfloat16", "uint8", "float8_e4m3fn", "float32", "float32", "float32", "bool"]

    saved = region.save(tmp_path / "w.dsw", chunk_bytes=8192, threads=3)
    assert saved.written
    region.release()
    assert not same_bytes(views["emb"], dict(named)["emb"])  # scribbled over while released
    result = region.load(tmp_path / "w.dsw", threads=4, block=8192, buffers=3, direct=direct)
    for name, t in named:
        assert same_bytes(views[name], t.detach()), name
    assert result.bytes == region.data_bytes
    assert cu.registered == {}  # every pinned buffer was unregistered
    registrations = [args for op, args in cu.calls if op == "cuMemHostRegister"]
    assert registrations
    assert all(addr % 4096 == 0 and flags == 1 for addr, _, flags in registrations)

    region.release()
    region.load(tmp_path / "w.dsw", verify=True)
    assert all(same_bytes(views[n], t.detach()) for n, t in named)


def test_torch_makes_and_expands_the_reference_codecs_records(cu: HostBackedDriver, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 1024, generator=gen) * 0.02).to(torch.bfloat16)
    w.view(-1)[::997] = 3.0e4  # rare odd bytes: every chunk has escapes
    region = WeightRegion(driver=cu, pool=RegionPool())
    views = region.pack([("w", w)])
    path = tmp_path / "w.dsw"
    region.save(path, chunk_bytes=64 << 10)
    header, data_offset = weights.read_header(path)
    assert header.encoding is not None
    assert all(k > 0 for k in header.encoding.escapes)
    raw = path.read_bytes()
    data = bytes(w.view(-1).view(torch.uint8).tolist()) + bytes(header.data_bytes - w.numel() * 2)
    for rec in header.records():
        record = raw[data_offset + rec.offset : data_offset + rec.offset + rec.stored]
        expected = weights.encode_coded(data[rec.data_offset : rec.data_offset + rec.nbytes])
        assert expected is not None
        assert record == expected + bytes(rec.stored - len(expected)), f"chunk {rec.index}"
    region.release()
    region.load(path, threads=3, buffers=2)
    assert same_bytes(views["w"], w)
    region.release()
    region.load(path, verify=True)
    assert same_bytes(views["w"], w)


def test_a_new_region_from_a_file_has_typed_views(cu: HostBackedDriver, tmp_path: Path) -> None:
    named = named_tensors()
    region = WeightRegion(driver=cu, pool=RegionPool())
    region.pack(named)
    region.save(tmp_path / "w.dsw")
    fresh = WeightRegion(driver=cu, pool=RegionPool())
    fresh.load(tmp_path / "w.dsw")
    views = fresh.views
    for name, t in named:
        assert views[name].dtype == t.dtype
        assert views[name].shape == t.shape
        assert same_bytes(views[name], t.detach())


def test_pack_module_repoints_parameters_and_buffers(cu: HostBackedDriver) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    model.register_buffer("scale", torch.full((4,), 2.0))
    x = torch.randn(3, 16)
    expected = model(x) * model.scale
    region = pack_module(model, driver=cu, pool=RegionPool())
    assert region.region is not None
    lo, hi = region.region.ptr, region.region.ptr + region.region.size
    for _, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert lo <= tensor.data_ptr() < hi
    assert isinstance(model[0].weight, torch.nn.Parameter)
    assert torch.equal(model(x) * model.scale, expected)
