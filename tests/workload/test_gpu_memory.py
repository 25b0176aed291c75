"""VmmRegion, RegionPool and KvCache sizing against a pure-Python stand-in for the driver (fake_cuda):
the order of driver calls, what stays reserved, rollback on failure, and the context handling. The
real driver is exercised on the H200 by tests/gpu/vmm_scenarios.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from dynamo_snapshot.cuda import CudaError
from dynamo_snapshot.workload import gpu_memory
from dynamo_snapshot.workload.gpu_memory import RegionPool, VmmRegion, round_up
from dynamo_snapshot.workload.kv_cache import KvCache
from tests.workload.fake_cuda import GARBAGE, CUresult, FakeDriver

GRAN = 64 << 10


@pytest.fixture
def cu() -> FakeDriver:
    driver = FakeDriver(granularity=GRAN)
    # A thread inside a torch worker: the primary context of device 0 is current.
    driver.set_current_for_test(FakeDriver.context_of(0))
    return driver


def test_round_up() -> None:
    assert [round_up(n, 4096) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


def test_region_reserves_aligned_maps_and_grants_access(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN + 1, 0, driver=cu)
    assert region.size == 2 * GRAN
    assert region.ptr % GRAN == 0
    assert region.mapped
    assert cu.reservations == {region.ptr: region.size}
    assert list(cu.mappings) == [region.ptr]
    assert cu.access[region.ptr] == (0, 3)  # device 0, read/write
    reserve = next(args for op, args in cu.calls if op == "cuMemAddressReserve")
    assert reserve == (2 * GRAN, GRAN, 0, 0)
    ops = cu.ops()
    assert ops.index("cuMemAddressReserve") < ops.index("cuMemCreate") < ops.index("cuMemMap")
    assert ops.index("cuMemMap") < ops.index("cuMemSetAccess")
    assert "cuCtxPushCurrent" not in ops  # the caller's context was on the right device


def test_release_keeps_the_address_range_and_reacquire_maps_the_same_address(cu: FakeDriver) -> None:
    region = VmmRegion(4 * GRAN, 0, driver=cu)
    ptr = region.ptr
    cu.memory(ptr)[:4] = b"data"
    cu.calls.clear()

    assert region.release() == 4 * GRAN
    assert not region.mapped
    assert cu.used == 0  # the physical memory is gone
    assert cu.reservations == {ptr: 4 * GRAN}  # the addresses are not
    assert cu.ops() == [
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        "cuCtxSynchronize",  # nothing may still run on it
        "cuMemUnmap",
        "cuMemRelease",
    ]
    assert region.release() == 0  # idempotent

    cu.calls.clear()
    assert region.reacquire() == 4 * GRAN
    assert region.ptr == ptr
    assert region.mapped
    assert [op for op in cu.ops() if op.startswith("cuMem")] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    assert cu.access[ptr] == (0, 3)
    assert cu.memory(ptr)[:4] == bytes([GARBAGE]) * 4  # contents are undefined after reacquire
    assert region.reacquire() == 0

    region.zero()
    assert set(cu.memory(ptr)) == {0}


def test_free_gives_the_range_back_and_ends_the_region(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN, 0, driver=cu)
    region.free()
    assert region.freed
    assert not region.mapped
    assert cu.reservations == {}
    assert cu.handles == {}
    region.free()  # idempotent
    with pytest.raises(RuntimeError, match="freed"):
        region.reacquire()
    with pytest.raises(RuntimeError, match="freed"):
        region.release()


def test_free_of_a_released_region(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN, 0, driver=cu)
    region.release()
    region.free()
    assert cu.reservations == {}
    assert cu.ops().count("cuMemUnmap") == 1


def test_map_failure_rolls_back_handle_and_reservation(cu: FakeDriver) -> None:
    cu.fail["cuMemMap"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError) as info:
        VmmRegion(GRAN, 0, driver=cu)
    assert info.value.op == "cuMemMap"
    assert info.value.result == "CUDA_ERROR_INVALID_VALUE"
    assert "fake CUDA_ERROR_INVALID_VALUE" in str(info.value)  # cuGetErrorString's text
    assert cu.handles == {}
    assert cu.reservations == {}


def test_set_access_failure_unmaps_and_releases(cu: FakeDriver) -> None:
    cu.fail["cuMemSetAccess"] = CUresult.CUDA_ERROR_NOT_SUPPORTED
    with pytest.raises(CudaError, match="cuMemSetAccess"):
        VmmRegion(GRAN, 0, driver=cu)
    assert (cu.mappings, cu.handles, cu.reservations) == ({}, {}, {})


def test_reacquire_out_of_memory_leaves_it_released_and_can_be_retried(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN, 0, driver=cu)
    region.release()
    cu.fail["cuMemCreate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as info:
        region.reacquire()
    assert info.value.result == "CUDA_ERROR_OUT_OF_MEMORY"
    assert not region.mapped
    assert cu.reservations == {region.ptr: GRAN}
    assert region.reacquire() == GRAN
    assert region.mapped


def test_no_current_context_pushes_the_primary_context_and_pops_it(cu: FakeDriver) -> None:
    cu.set_current_for_test(0)  # a thread that never touched CUDA
    region = VmmRegion(GRAN, 1, driver=cu)
    assert cu.current() == 0  # left as it was
    assert cu.retained == [1]
    assert cu.ops().count("cuCtxPushCurrent") == cu.ops().count("cuCtxPopCurrent") > 0
    region.release()
    region.reacquire()
    assert cu.retained == [1]  # retained once per device, not per call


def test_context_of_another_device_is_not_used(cu: FakeDriver) -> None:
    cu.set_current_for_test(FakeDriver.context_of(0))
    VmmRegion(GRAN, 1, driver=cu)
    pushes = [args for op, args in cu.calls if op == "cuCtxPushCurrent"]
    assert pushes
    assert all(args == (FakeDriver.context_of(1),) for args in pushes)
    assert cu.current() == FakeDriver.context_of(0)


def test_calls_from_another_thread_use_a_context(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN, 0, driver=cu)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            region.release()
            region.reacquire()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == []
    assert region.mapped


def test_bad_arguments(cu: FakeDriver) -> None:
    for size in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="size_bytes"):
            VmmRegion(size, 0, driver=cu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device"):
        VmmRegion(GRAN, -1, driver=cu)


def test_pool_releases_and_reacquires_by_kind(cu: FakeDriver) -> None:
    pool = RegionPool()
    kv1 = VmmRegion(GRAN, 0, kind="kv", pool=pool, driver=cu)
    kv2 = VmmRegion(2 * GRAN, 0, kind="kv", pool=pool, driver=cu)
    weights = VmmRegion(GRAN, 0, kind="weights", pool=pool, driver=cu)
    VmmRegion(GRAN, 0, driver=cu)  # no kind: not in any pool

    assert pool.regions() == [kv1, kv2, weights]
    assert pool.mapped_bytes("kv") == 3 * GRAN
    assert pool.release("kv") == 3 * GRAN
    assert (kv1.mapped, kv2.mapped, weights.mapped) == (False, False, True)
    assert pool.release("kv") == 0
    assert pool.reacquire() == 3 * GRAN
    assert all(r.mapped for r in pool.regions())
    kv2.free()
    assert pool.regions("kv") == [kv1]


def test_default_pool_is_used_for_a_kind(cu: FakeDriver) -> None:
    region = VmmRegion(GRAN, 0, kind="test-default-pool", driver=cu)
    try:
        assert gpu_memory.DEFAULT_POOL.regions("test-default-pool") == [region]
    finally:
        region.free()
    assert gpu_memory.DEFAULT_POOL.regions("test-default-pool") == []


def test_kv_cache_size_in_bytes_or_as_a_fraction_of_free_memory(cu: FakeDriver) -> None:
    kv = KvCache(3 * GRAN + 5, driver=cu, pool=RegionPool())
    assert kv.size == 4 * GRAN
    free = cu.total - cu.used
    frac = KvCache(0.5, headroom_bytes=GRAN, driver=cu, pool=RegionPool())
    assert frac.size == (free - GRAN) // 2 // GRAN * GRAN  # rounded down, so it fits
    assert frac.region.kind == "kv"

    assert kv.release_for_checkpoint() == 4 * GRAN
    assert kv.released
    assert kv.reacquire_after_restore(zero=True) == 4 * GRAN
    assert set(cu.memory(kv.region.ptr)) == {0}
    kv.free()
    assert kv.region.freed


def test_kv_cache_bad_sizes(cu: FakeDriver) -> None:
    for size, error in (
        (0, ValueError),
        (1.5, ValueError),
        (0.0, ValueError),
        (True, TypeError),
        ("1", TypeError),
    ):
        with pytest.raises(error):
            KvCache(size, driver=cu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allocation unit"):
        KvCache(1e-9, driver=cu)


def test_the_sdk_imports_and_fails_clearly_without_cuda_python_or_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cuda"] = None       # import cuda... raises ImportError
        sys.modules["torch"] = None
        sys.modules["numpy"] = None
        import dynamo_snapshot.workload as w
        from dynamo_snapshot.cuda import CudaUnavailableError
        from dynamo_snapshot.workload import weights, kv_cache, gpu_memory, offload
        print(w.FILE_WEIGHTS_MANIFEST)
        print(weights.plan_layout([("a", "uint8", (3,), 3), ("b", "float32", (2,), 8)])[1])
        for make in (lambda: w.VmmRegion(1), lambda: w.KvCache(0.5)):
            try:
                make()
            except CudaUnavailableError as e:
                print("unavailable:", "cuda-python" in str(e))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["weights.json", "264", "unavailable: True", "unavailable: True"]
