"""Where the zero pages of a CUDA checkpoint come from, and what a worker can give back before it.

Each variant starts a torch process that sets up some GPU state and waits; this script reads the GPU
memory NVML counts for it, suspends it with the CUDA checkpoint API (the agent's own ``CudaCheckpointer``:
the driver copies the process's GPU memory into its host memory), counts the present pages of its writable
private memory and how many of them are all zero (``/proc/PID/pagemap`` and ``/proc/PID/mem``) before
and after, resumes it and has it check its results.

Variants: ``base`` (a matmul), ``graph`` (+ a captured CUDA graph), ``lmem`` (+ a kernel with 16 KiB of
local memory per thread, which makes the driver grow the context's local-memory reserve), ``lmem_reset``
(``lmem``, then the stack-size limit set again, which sizes the reserve anew), ``cublas_clear`` (+ torch's
cuBLAS workspaces given back), ``release`` (``graph``, and after the checkpoint call the process drops the
zero pages of the mappings the driver made during it, ``dynamo_snapshot.workload.zero_pages``).

    python3 benchmarks/gpu/zero_sources.py --out $OUT/zero-sources.json [VARIANT ...]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from dynamo_snapshot.cuda import CudaCheckpointer, gpu_memory_by_pid  # noqa: E402
from dynamo_snapshot.workload.zero_pages import Mapping, private_anonymous, read_maps  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
ZERO = bytes(PAGE)

CHILD = r"""
import ctypes, json, os, sys, time
import torch
variant = sys.argv[1]
control = sys.argv[2]
dev = torch.device("cuda")
x = torch.randn(4096, 4096, device=dev)
y = x @ x
results = {}
if variant in ("graph", "lmem", "lmem_reset", "cublas_clear", "release"):
    static = torch.randn(2048, 2048, device=dev)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            out = static @ static
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = static @ static
    g.replay()
    results["graph"] = (g, static, out, (static @ static).clone())
if variant in ("lmem", "lmem_reset"):
    code = '''template <typename T> T deep(T x) {
        volatile T buf[4096];
        for (int i = 0; i < 4096; ++i) buf[i] = x + T(i);
        return buf[((int)x) & 4095];
    }'''
    fn = torch.cuda.jiterator._create_jit_fn(code)
    z = fn(torch.arange(1 << 20, device=dev, dtype=torch.float32))
    results["lmem"] = float(z[5])
libcuda = ctypes.CDLL("libcuda.so.1")
def stack():
    v = ctypes.c_size_t()
    libcuda.cuCtxGetLimit(ctypes.byref(v), 0)
    return v.value
before_reset = torch.cuda.mem_get_info()[0]
if variant == "lmem_reset":
    rc = libcuda.cuCtxSetLimit(0, ctypes.c_size_t(stack()))
    results["reset_rc"] = rc
if variant == "cublas_clear":
    torch._C._cuda_clearCublasWorkspaces()
torch.cuda.synchronize()
report = {"stack": stack(), "freed_by_reset": torch.cuda.mem_get_info()[0] - before_reset,
          "reserved": torch.cuda.memory_reserved(), "reset_rc": results.get("reset_rc")}
open(control + "/ready.tmp", "w").write(json.dumps(report))
os.replace(control + "/ready.tmp", control + "/ready")
while not os.path.exists(control + "/go"):
    if os.path.exists(control + "/release.json") and not os.path.exists(control + "/released.json"):
        from dynamo_snapshot.workload.zero_pages import release_zero_pages
        ranges = [tuple(r) for r in json.load(open(control + "/release.json"))]
        stats = release_zero_pages(ranges)
        open(control + "/released.tmp", "w").write(json.dumps(stats.to_dict()))
        os.replace(control + "/released.tmp", control + "/released.json")
    time.sleep(0.005)
ok = bool(torch.equal(x @ x, y))
if "graph" in results:
    g, static, out, want = results["graph"]
    g.replay()
    torch.cuda.synchronize()
    ok = ok and bool(torch.equal(out, want))
if "lmem" in results:
    z = fn(torch.arange(1 << 20, device=dev, dtype=torch.float32))
    ok = ok and float(z[5]) == results["lmem"]
open(control + "/done", "w").write(json.dumps({"ok": ok}))
"""


def new_vmas(before: list[Mapping], after: list[Mapping]) -> list[tuple[int, int]]:
    old = set(private_anonymous(before))
    return [r for r in private_anonymous(after) if r not in old]


def census(pid: int) -> dict[str, int]:
    """Present pages of the writable private mappings, and how many are all zero."""
    present = zero = 0
    with (
        open(f"/proc/{pid}/maps") as maps,
        open(f"/proc/{pid}/pagemap", "rb") as pm,
        open(f"/proc/{pid}/mem", "rb", buffering=0) as mem,
    ):
        for line in maps:
            fields = line.split()
            perms = fields[1]
            if not (perms.startswith("rw") and perms[3] == "p"):
                continue
            name = fields[5] if len(fields) > 5 else ""
            if name.startswith("/dev/") or name == "[vvar]":
                continue
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            pm.seek(lo // PAGE * 8)
            bits = pm.read((hi - lo) // PAGE * 8)
            for i, (entry,) in enumerate(struct.iter_unpack("<Q", bits)):
                if not entry >> 63:
                    continue
                present += 1
                try:
                    mem.seek(lo + i * PAGE)
                    if mem.read(PAGE) == ZERO:
                        zero += 1
                except OSError:
                    pass
    return {"present_bytes": present * PAGE, "zero_bytes": zero * PAGE}


def run(variant: str, work: Path) -> dict[str, Any]:
    control = work / variant
    control.mkdir(parents=True, exist_ok=True)
    for name in ("ready", "go", "done"):
        (control / name).unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, variant, str(control)])
    try:
        deadline = time.monotonic() + 120
        while not (control / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                return {"error": f"child ended {proc.returncode} before it was ready"}
            time.sleep(0.05)
        report: dict[str, Any] = {"child": json.loads((control / "ready").read_text())}
        report["gpu_bytes"] = gpu_memory_by_pid().get(proc.pid)
        report["before"] = census(proc.pid)
        cp = CudaCheckpointer()
        t = time.monotonic()
        cp.lock(proc.pid)
        maps_before = read_maps(proc.pid)
        cp.checkpoint(proc.pid)
        report["suspend_s"] = round(time.monotonic() - t, 3)
        new = new_vmas(maps_before, read_maps(proc.pid))
        report["new_vmas"] = {"count": len(new), "bytes": sum(hi - lo for lo, hi in new)}
        report["after"] = census(proc.pid)
        if variant == "release":
            t = time.monotonic()
            (control / "release.json").write_text(json.dumps(new))
            while not (control / "released.json").exists():
                time.sleep(0.002)
            report["release_s"] = round(time.monotonic() - t, 3)
            report["released"] = json.loads((control / "released.json").read_text())
            report["after_release"] = census(proc.pid)
        t = time.monotonic()
        cp.restore(proc.pid)
        cp.unlock(proc.pid)
        report["resume_s"] = round(time.monotonic() - t, 3)
        (control / "go").write_text("go")
        proc.wait(120)
        done = control / "done"
        report["verdict"] = json.loads(done.read_text()) if done.exists() else None
        added = report["after"]["present_bytes"] - report["before"]["present_bytes"]
        added_zero = report["after"]["zero_bytes"] - report["before"]["zero_bytes"]
        report["suspend_added_bytes"] = added
        report["suspend_added_zero_bytes"] = added_zero
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=["graph", "release"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/zero-sources"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = {}
    for v in args.variants:
        try:
            results[v] = run(v, args.work)
        except Exception as e:  # one variant's failure must not cost the others' numbers
            results[v] = {"error": repr(e)}
        print(v, json.dumps(results[v]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
