"""VmmRegion, KvCache and WeightRegion on a real GPU (the H200 machine), and what they save a checkpoint.

    python3 -m tests.gpu.vmm_scenarios OUTDIR [SCENARIO ...]

from the repository root. Each scenario runs in a child process of its own (its own CUDA context, a
timeout, a stack dump if it hangs); one JSON line per scenario on stdout, {"scenario", "status":
"PASS"|"FAIL", "seconds", ...measurements}; exit status 1 if any failed. OUTDIR/<scenario>/ keeps
each child's log and report. Big files go to $VMM_SCRATCH (default /var/tmp) and are removed at the
end. Needs torch, cuda-bindings and this repository (pydantic for its imports); root for
drop_caches (without it the weights file is evicted with posix_fadvise instead).

- kv_graph: a 2 GiB KvCache, tensors in it, a CUDA graph captured over them; release frees ~2 GiB
  (torch.cuda.mem_get_info), reacquire maps the same addresses, and the graph's replay is bit-exact.
- weights_file: ~4 GiB of random weights packed into a WeightRegion; save, release, drop the page
  cache, load with 16 threads (O_DIRECT), and again warm (after warm_page_cache) and verified;
  bit-exact every time (the original tensors, int64 sums, a matmul); GB/s of each load.
- checkpoint_cycle: a worker subprocess (vmm_worker.py) with a KvCache and a WeightRegion, once
  releasing them through the handshake and once not; CUDA lock + checkpoint, the worker's VmRSS
  before and after (the host memory the checkpoint took), restore + unlock, restore-complete; the
  worker reacquires, loads and checks everything bit-exact.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
MIB = 1 << 20


class ScenarioError(AssertionError):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioError(message)


def scratch_dir() -> Path:
    base = Path(os.environ.get("VMM_SCRATCH", "/var/tmp"))
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="vmm-scenarios-", dir=base))


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (from /proc/self/mounts)."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def evict(path: Path) -> dict[str, Any]:
    """Drop the page cache (needs root), else at least this file's pages."""
    out: dict[str, Any] = {}
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        out["drop_caches"] = True
    except OSError as e:
        out["drop_caches"] = f"failed: {e}"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    from dynamo_snapshot.workload.weights import page_cache_fraction

    out["resident_after"] = page_cache_fraction(path)
    return out


def bitwise_equal(torch: Any, a: Any, b: Any) -> bool:
    """Equal as bytes (NaN-safe, any dtype)."""
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def checksum(torch: Any, t: Any) -> int:
    flat = t.reshape(-1).view(torch.uint8)
    if flat.numel() % 8 == 0:
        return int(flat.view(torch.int64).sum().item())
    return int(flat.sum(dtype=torch.int64).item())


# ---- (i) KV cache + CUDA graph ---------------------------------------------------------------------


def kv_graph(work: Path, report: dict[str, Any]) -> None:
    import torch

    from dynamo_snapshot.workload import KvCache, RegionPool

    report["torch"] = torch.__version__
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    report["gpu"] = torch.cuda.get_device_name(dev)
    try:
        import numpy

        report["numpy"] = numpy.__version__
    except ImportError:
        report["numpy"] = None
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        report["cuda_bindings"] = version("cuda-bindings")

    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info(dev)
    kv = KvCache(2 * GIB, device=0, pool=RegionPool())
    free1, _ = torch.cuda.mem_get_info(dev)
    report["granularity"] = kv.region.granularity
    report["created_mib"] = (free0 - free1) // MIB
    check(free0 - free1 >= 0.95 * 2 * GIB, f"creating 2 GiB took only {(free0 - free1) // MIB} MiB")
    ptr = kv.region.ptr
    half = GIB // 2  # fp16 elements in 1 GiB
    k = kv.allocate("k", (half,), torch.float16)
    v = kv.allocate("v", (half,), torch.float16)
    report["tensor_path"] = kv.region.tensor_path
    check(int(k.data_ptr()) == ptr, "k does not start at the region")
    check(int(v.data_ptr()) == ptr + GIB, "v is not at region + 1 GiB")
    check(kv.free_bytes == 0, f"{kv.free_bytes} bytes left over")

    # Both ways of viewing the region, whichever 'auto' chose.
    for via in ("cuda_array_interface", "storage_pointer"):
        try:
            t = kv.region.as_tensor(torch.int32, (16,), 4096, via=via)  # type: ignore[arg-type]
            report[f"via_{via}"] = "ok" if int(t.data_ptr()) == ptr + 4096 else "copied"
        except Exception as e:
            report[f"via_{via}"] = f"{type(e).__name__}: {e}"

    gen = torch.Generator(device=dev)
    gen.manual_seed(11)
    src = torch.randn(half, device=dev, dtype=torch.float16, generator=gen)

    def step() -> Any:
        k.copy_(src)
        torch.mul(k, 2, out=v)
        return torch.sum(v[: 1 << 24], dtype=torch.float32)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    out_ref = float(out.item())
    v_ref = v.clone()
    torch.cuda.synchronize()

    cycles = []
    for cycle in range(2):
        free_mapped, _ = torch.cuda.mem_get_info(dev)
        t = time.perf_counter()
        released = kv.release_for_checkpoint()
        release_s = time.perf_counter() - t
        free_released, _ = torch.cuda.mem_get_info(dev)
        check(not kv.region.mapped, "still mapped after release")
        check(released == 2 * GIB, f"release returned {released}")
        check(
            free_released - free_mapped >= 0.95 * 2 * GIB,
            f"release freed only {(free_released - free_mapped) // MIB} MiB",
        )
        t = time.perf_counter()
        kv.reacquire_after_restore()
        reacquire_s = time.perf_counter() - t
        free_again, _ = torch.cuda.mem_get_info(dev)
        check(kv.region.ptr == ptr and int(k.data_ptr()) == ptr, "the address moved")
        check(abs(free_again - free_mapped) <= 64 * MIB, "reacquire did not take the memory back")
        survived = bitwise_equal(torch, v, v_ref)  # informative: contents are undefined
        k.fill_(0)
        v.fill_(0)
        out.zero_()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        check(bitwise_equal(torch, v, v_ref), f"cycle {cycle}: the graph's replay wrote other values")
        check(float(out.item()) == out_ref, f"cycle {cycle}: graph output {out.item()} != {out_ref}")
        cycles.append(
            {
                "freed_mib": (free_released - free_mapped) // MIB,
                "release_s": round(release_s, 4),
                "reacquire_s": round(reacquire_s, 4),
                "contents_survived": survived,
            }
        )
    report["cycles"] = cycles

    torch.cuda.synchronize()
    before_free, _ = torch.cuda.mem_get_info(dev)
    kv.free()
    after_free, _ = torch.cuda.mem_get_info(dev)
    report["free_returned_mib"] = (after_free - before_free) // MIB
    check(after_free - before_free >= 0.95 * 2 * GIB, "free() did not return the memory")


# ---- (ii) weights file -----------------------------------------------------------------------------


def weights_file(work: Path, report: dict[str, Any]) -> None:
    import torch

    from dynamo_snapshot.workload import RegionPool, WeightRegion, warm_page_cache
    from dynamo_snapshot.workload.weights import ENCODING_RAW, page_cache_fraction, read_header

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    scratch = scratch_dir()
    path = scratch / "weights.dsw"
    report["scratch"] = str(scratch)
    report["scratch_fs"] = fs_type(scratch)
    try:
        named: list[tuple[str, Any]] = [
            (f"layer{i}.w", torch.randn(8192, 16384, device=dev, dtype=torch.bfloat16, generator=gen))
            for i in range(15)
        ]
        named += [
            ("odd.u8", torch.randint(0, 256, (1_000_003,), dtype=torch.uint8, device=dev, generator=gen)),
            ("odd.f32", torch.randn(7, 13, device=dev, generator=gen)),
            ("cpu.i64", torch.arange(1000, dtype=torch.int64)),  # on the host: pack copies it over
            ("big.f16", torch.randn(64 << 20, device=dev, dtype=torch.float16, generator=gen)),
            ("strided.f32", torch.randn(512, 1024, device=dev, generator=gen).t()),  # not contiguous
        ]
        region = WeightRegion(device=0, pool=RegionPool())
        t = time.perf_counter()
        views = region.pack(named)
        report["pack_s"] = round(time.perf_counter() - t, 3)
        assert region.region is not None
        ptr = region.region.ptr
        report["region_gib"] = round(region.region.size / GIB, 3)
        report["tensor_path"] = region.region.tensor_path
        for spec in region.specs:
            check(int(views[spec.name].data_ptr()) == ptr + spec.offset, f"{spec.name} is not at its offset")
            check(spec.offset % 256 == 0, f"{spec.name} at {spec.offset} is not 256-aligned")
        sources = dict(named)
        for name, src in sources.items():
            check(bitwise_equal(torch, views[name], src.to(dev)), f"pack changed {name}")
        sums = {name: checksum(torch, v) for name, v in views.items()}
        x = torch.randn(16384, 64, device=dev, dtype=torch.bfloat16, generator=gen)
        mm_ref = views["layer0.w"] @ x
        torch.cuda.synchronize()

        def verify(label: str) -> None:
            check(region.region is not None and region.region.ptr == ptr, f"{label}: the address moved")
            for name, src in sources.items():
                check(bitwise_equal(torch, views[name], src.to(dev)), f"{label}: {name} differs")
            bad = [name for name, v in views.items() if checksum(torch, v) != sums[name]]
            check(not bad, f"{label}: checksums differ for {bad[:5]}")
            check(bitwise_equal(torch, views["layer0.w"] @ x, mm_ref), f"{label}: matmul differs")

        saved = region.save(path)  # split-nibble, the default
        report["save"] = saved.to_dict()
        check(saved.written, "the first save did not write")
        header, data_offset = read_header(path)
        check(header.encoding is not None, "the default save is not split-nibble")
        check(path.stat().st_size == data_offset + header.stored_bytes, "file size")
        check(data_offset % 4096 == 0, "data offset not aligned")
        raw_path = scratch / "weights-raw.dsw"
        raw = region.save(raw_path, encoding=ENCODING_RAW)
        report["save_raw"] = raw.to_dict()
        report["split_ratio"] = round(raw.bytes / saved.bytes, 3)
        check(raw.data_digest == saved.data_digest, "raw and split files disagree on the data digest")
        check(saved.bytes < 0.8 * raw.bytes, f"split-nibble saved only {raw.bytes - saved.bytes} bytes")
        torch.cuda.synchronize()
        free_mapped, _ = torch.cuda.mem_get_info(dev)

        def release() -> int:
            torch.cuda.synchronize()
            free_before, _ = torch.cuda.mem_get_info(dev)
            region.release()
            free_after, _ = torch.cuda.mem_get_info(dev)
            return free_after - free_before

        freed = release()
        report["released_gib"] = round(freed / GIB, 3)
        check(freed >= 0.95 * header.data_bytes, f"release freed only {freed // MIB} MiB")
        report["evict"] = evict(path)
        cold = region.load(path, threads=16)
        report["load_cold"] = cold.to_dict()
        free_loaded, _ = torch.cuda.mem_get_info(dev)
        # The load's device scratch (records on their way to the region) is given back. (Measured
        # before verify(), whose comparisons leave temporaries in torch's cache.)
        check(free_loaded >= free_mapped - 2 * MIB, f"the load kept {(free_mapped - free_loaded) // MIB} MiB")
        verify("cold load")

        release()
        report["evict_raw"] = evict(raw_path)
        cold_raw = region.load(raw_path, threads=16)
        report["load_cold_raw"] = cold_raw.to_dict()
        verify("cold load of the raw file")

        release()
        warm = warm_page_cache(path, threads=16)
        report["warm_page_cache"] = {"gbps": round(warm.gbps, 2), "seconds": round(warm.seconds, 3)}
        report["resident_after_warm"] = page_cache_fraction(path)
        hot = region.load(path, threads=16)
        report["load_warm"] = hot.to_dict()
        verify("warm load")

        release()
        checked = region.load(path, threads=16, verify=True)
        report["load_verified"] = checked.to_dict()
        verify("verified load")

        release()
        forced = region.load(path, threads=16, direct=True)
        report["load_direct_forced"] = forced.to_dict()
        verify("forced O_DIRECT load")

        again = region.save(path)
        check(not again.written, "an identical save was written again")
        check(again.data_digest == saved.data_digest, "data digest of the unchanged file changed")
        report["save_again_s"] = round(again.seconds, 3)
        region.free()  # the views are not touched again
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ---- (iii) the CUDA checkpoint cycle ---------------------------------------------------------------

KV_MIB = int(os.environ.get("VMM_KV_MIB", "2048"))
WEIGHTS_MIB = int(os.environ.get("VMM_WEIGHTS_MIB", "2048"))
READY_TIMEOUT_S = 180.0
RESULT_TIMEOUT_S = 150.0


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-4000:]
    return ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cycle(workdir: Path, mode: str, scratch: Path, report: dict[str, Any]) -> None:
    """One worker through lock, checkpoint, restore, unlock and its checks; measurements into `report`
    as they are taken, so a failure keeps what came before it."""
    from dynamo_snapshot.api.protocol import FILE_READY_FOR_SNAPSHOT, FILE_RESTORE_COMPLETE
    from dynamo_snapshot.cuda import CudaCheckpointer, ProcessState, gpu_device_fds

    cp = CudaCheckpointer()
    control = workdir / "control"
    control.mkdir(parents=True)
    log_path = workdir / "worker.log"
    argv = [
        sys.executable,
        "-m",
        "tests.gpu.vmm_worker",
        str(workdir),
        mode,
        str(scratch / f"weights-{mode}.dsw"),
        str(KV_MIB),
        str(WEIGHTS_MIB),
    ]
    with log_path.open("wb") as log:
        # Same process group as this scenario: a timeout that kills the group kills the worker too.
        proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (control / FILE_READY_FOR_SNAPSHOT).exists():
            check(proc.poll() is None, f"worker exited {proc.returncode} before ready:\n{_tail(log_path)}")
            check(
                time.monotonic() < deadline,
                f"worker not ready in {READY_TIMEOUT_S:.0f} s:\n{_tail(log_path)}",
            )
            time.sleep(0.05)
        pid = proc.pid
        report["pre"] = json.loads((workdir / "pre.json").read_text())
        check(cp.state(pid) is ProcessState.RUNNING, f"worker is {cp.state(pid)}")
        report["rss_ready_kib"] = memory_kib(pid)
        avail_ready = mem_available_kib()

        t = time.perf_counter()
        cp.lock(pid, timeout_ms=10_000)
        report["lock_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        cp.checkpoint(pid)
        report["checkpoint_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.CHECKPOINTED, f"after checkpoint: {cp.state(pid)}")
        report["rss_checkpointed_kib"] = memory_kib(pid)
        report["mem_available_drop_mib"] = (avail_ready - mem_available_kib()) // 1024
        report["gpu_fds_checkpointed"] = gpu_device_fds(pid)
        report["rss_delta_mib"] = (
            report["rss_checkpointed_kib"]["VmRSS"] - report["rss_ready_kib"]["VmRSS"]
        ) // 1024

        t = time.perf_counter()
        cp.restore(pid)
        report["restore_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        cp.unlock(pid)
        report["unlock_s"] = round(time.perf_counter() - t, 4)
        check(cp.state(pid) is ProcessState.RUNNING, f"after unlock: {cp.state(pid)}")
        report["rss_restored_kib"] = memory_kib(pid)

        _write_atomic(control / FILE_RESTORE_COMPLETE, json.dumps({"podName": f"restored-{mode}"}))
        result_path = workdir / "result.json"
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while not result_path.exists():
            check(
                proc.poll() is None or result_path.exists(),
                f"worker exited {proc.returncode} without a result:\n{_tail(log_path)}",
            )
            check(time.monotonic() < deadline, f"no result in {RESULT_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.05)
        verdict = json.loads(result_path.read_text())
        report["verdict"] = verdict
        check("error" not in verdict, f"worker failed after the restore:\n{verdict.get('error')}")
        for key in ("restored", "ptrs_ok", "weights_ok", "mm_ok", "graph_ok", "fresh_alloc_ok"):
            check(verdict.get(key) is True, f"{mode} worker: {key} is {verdict.get(key)!r}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


def checkpoint_cycle(work: Path, report: dict[str, Any]) -> None:
    from dynamo_snapshot.cuda import CudaCheckpointer

    report["driver_version"] = CudaCheckpointer().driver_version()
    report["kv_mib"], report["weights_mib"] = KV_MIB, WEIGHTS_MIB
    scratch = scratch_dir()
    report["scratch_fs"] = fs_type(scratch)
    failed = []
    try:
        # Both modes even when the first fails: the other one's numbers still say something.
        for mode in ("release", "keep"):
            report[mode] = {"mode": mode}
            try:
                _cycle(work / mode, mode, scratch, report[mode])
            except Exception as e:
                report[mode]["error"] = f"{type(e).__name__}: {e}"
                failed.append(mode)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check(not failed, f"the {' and '.join(failed)} cycle failed (see its 'error')")
    release, keep = report["release"], report["keep"]
    r, k = release["rss_delta_mib"], keep["rss_delta_mib"]
    report["rss_delta_mib"] = {"release": r, "keep": k}
    offload = release["verdict"].get("offload", {})
    report["release_worker_load"] = offload.get("loaded")
    ra, ka = release["mem_available_drop_mib"], keep["mem_available_drop_mib"]
    report["mem_available_drop_mib"] = {"release": ra, "keep": ka}
    if k < 512 and ka >= 1024:
        # Not in the process's RSS (kept by the kernel driver?): the machine's MemAvailable still shows it.
        report["memory_comparison"] = f"by MemAvailable: release {ra} MiB, keep {ka} MiB ({ra / ka:.1%})"
        check(ra < 0.5 * ka, f"releasing did not shrink the checkpoint: {ra} MiB vs {ka} MiB")
    elif k < 512:
        report["memory_comparison"] = "inconclusive: the checkpoint showed neither in VmRSS nor MemAvailable"
    else:
        report["memory_comparison"] = f"release used {r} MiB, keep {k} MiB ({r / k:.1%})"
        check(r < 0.5 * k, f"releasing did not shrink the checkpoint: {r} MiB vs {k} MiB")


# ---- running ---------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[Callable[[Path, dict[str, Any]], None], float]] = {
    "kv_graph": (kv_graph, 90.0),
    "weights_file": (weights_file, 180.0),
    "checkpoint_cycle": (checkpoint_cycle, 300.0),
}


def _child(name: str, work: Path) -> int:
    """Run one scenario here; its report goes to work/report.json."""
    fn, timeout = SCENARIOS[name]
    faulthandler.dump_traceback_later(max(5.0, timeout - 5.0), exit=False)
    report: dict[str, Any] = {}
    try:
        fn(work, report)
        faulthandler.cancel_dump_traceback_later()
        report["status"] = "PASS"
    except Exception as e:
        # What was measured before the failure stays in the report.
        report.update(status="FAIL", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    (work / "report.json").write_text(json.dumps(report, default=str))
    return 0


@contextlib.contextmanager
def _group(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


def run(name: str, out: Path) -> dict[str, Any]:
    _, timeout = SCENARIOS[name]
    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    with (work / "scenario.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.vmm_scenarios", "--child", name, str(work)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a timeout kills it and its worker together
        )
    with _group(proc):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    report: dict[str, Any]
    try:
        report = json.loads((work / "report.json").read_text())
    except (OSError, ValueError):
        killed = proc.returncode == -signal.SIGKILL
        why = f"timed out after {timeout:.0f} s" if killed else f"exit {proc.returncode}"
        report = {"status": "FAIL", "error": f"no report ({why})", "log": _tail(work / "scenario.log")}
    status = report.pop("status", "FAIL")
    return {"scenario": name, "status": status, "seconds": round(time.monotonic() - started, 2), **report}


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "--child":
        return _child(argv[2], Path(argv[3]))
    if len(argv) < 2 or argv[1].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1]).absolute()
    names = argv[2:] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        line = run(name, out)
        failed += line["status"] != "PASS"
        print(json.dumps(line, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
