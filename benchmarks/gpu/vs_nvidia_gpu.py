"""The GPU reference worker checkpointed and restored the way NVIDIA's snapshot agent does it, on the machine
and disk where benchmarks/gpu/restore_bench.py restores it through this project's agent: one device call,
the same worker (restore_bench's stock mode: the handshake only, no weight decoupling, no offer to
drop zero pages), the same model files and compile cache.

What NVIDIA's agent (ai-dynamo/snapshot, NVIDIA_SNAPSHOT_COMMIT in scripts/versions.env) does with a CUDA
process, as its source and chart say, and what this script runs in its place:

- checkpoint: the driver's CUDA checkpoint of every CUDA process of the container (lock, then checkpoint:
  device memory copied into the process's host memory), then one `criu dump` into a directory of plain
  CRIU images (its chart's options: --tcp-established --file-locks --ext-unix-sk --shell-job
  --link-remap --ghost-limit 512 MiB), no compression, no digests. It calls the driver through its own
  `cuda-checkpoint-helper`; here NVIDIA's `cuda-checkpoint` utility (NVIDIA/cuda-checkpoint, the
  binary its agent image also carries) makes the same four calls.
- restore: `criu restore` of those images (upstream CRIU's criu-dev branch, which its image builds; its
  own plugin dir holds only an inet-remap plugin, not CRIU's CUDA plugin; --evasive-devices), then
  the CUDA restore and unlock of each CUDA process, then the worker's go-ahead.

Not run: its Kubernetes parts (operator, PodSnapshot, restore pod, nsrestore entering the placeholder's
namespaces, the rootfs diff, the GPU UUID map), which the CPU comparison (benchmarks/vs_nvidia_snapshot.py)
runs with its real agent. The go-ahead is this project's `restore-complete`, the handshake the worker
speaks; NVIDIA's agent signals a Dynamo worker the same way.

    python3 benchmarks/gpu/vs_nvidia_gpu.py --size 1g --criu DIR/criu --cuda-checkpoint FILE --out $OUT

Run after restore_bench.py in the same work dir (the prepared model, its compile cache). Writes
OUT/gpu-nvidia-path-<size>.json: the cold start, the checkpoint's phases and bytes, then `--restores`
restores with the page cache dropped and `--warm` with it warm, each timed from the restore's start to
the worker's first /health 200, its first token and full answer compared with the cold worker's, and the
CPU seconds of CRIU, cuda-checkpoint and the restored tree's own restore work (host.tree_cpu_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.compare_vs_nvidia import spread  # noqa: E402
from benchmarks.gpu.host import (  # noqa: E402
    cpu_seconds,
    drop_caches,
    helpers_cpu_seconds,
    host_facts,
    http,
    tree_cpu_seconds,
    wait_gone,
    wait_json,
)
from benchmarks.gpu.restore_bench import storage_gbps, wait_serving, worker_command, worker_env  # noqa: E402
from dynamo_snapshot.agent import restore_complete  # noqa: E402
from dynamo_snapshot.agent.checkpoint import wait_ready  # noqa: E402
from dynamo_snapshot.agent.runtime import ProcessRuntime, WorkloadSpec  # noqa: E402
from dynamo_snapshot.api import protocol  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402
from dynamo_snapshot.criu.argv import TreeOptions  # noqa: E402
from dynamo_snapshot.cuda import find_cuda_pids  # noqa: E402

# NVIDIA's chart defaults (charts/snapshot/values.yaml at NVIDIA_SNAPSHOT_COMMIT), as CRIU flags.
NV_TREE = TreeOptions(ext_unix_sk=True, file_locks=True, tcp_established=True, shell_job=True)
NV_GHOST_LIMIT = 512 << 20
NV_RESTORE_ARGS = ("--evasive-devices",)
KEY = "nvidia-path"


class NvidiaPath:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        # The readers and huge-pages settings only reach a CRIU built with this project's patches; upstream
        # criu-dev ignores them, and restore_readers=1 / no huge pages keep even a patched one stock.
        self.criu = Criu(args.criu, restore_huge_pages=False, restore_readers=1)
        self.runtime = ProcessRuntime(self.work / "nvidia-control", self.criu)
        self.images = self.work / "nvidia-images"
        self.port = 18100
        self.result: dict[str, Any] = {"size": args.size, "kv_gib": args.kv_gib, "restores": []}
        self.out = args.out / f"gpu-nvidia-path-{args.size}.json"
        self.cuda_pids: list[int] = []
        self.go_ahead_format = restore_complete.JSON

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=1))

    async def cuda_checkpoint(self, action: str, pid: int) -> float:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(self.args.cuda_checkpoint), "--action", action, "--pid", str(pid),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(
                f"cuda-checkpoint --action {action} --pid {pid}: {out.decode(errors='replace')}"
            )
        return time.monotonic() - started

    def libdir(self) -> tuple[str, ...]:
        """A plugin dir of CRIU's own, as NVIDIA's chart sets one: the host's (which may hold CRIU's CUDA
        plugin) is never searched. Its one plugin, inet-remap, acts on established TCP across an IP change,
        which a worker restored on its own host has none of; the dir is left empty."""
        empty = self.work / "nvidia-criu-plugins"
        empty.mkdir(parents=True, exist_ok=True)
        return ("--libdir", str(empty))

    def worker_cmd(self) -> list[str]:
        return worker_command(self.args, self.work / "models" / self.args.size, "stock", self.port)

    async def prepare(self) -> None:
        """The model files, where restore_bench.py left none in this work dir."""
        if any((self.work / "models" / self.args.size).glob("*.safetensors")):
            return
        proc = await asyncio.create_subprocess_exec(
            *self.worker_cmd(), "--prepare-only", env={**os.environ, **self.env()}
        )
        if await proc.wait() != 0:
            raise RuntimeError("preparing the model failed")

    def env(self) -> dict[str, str]:
        return worker_env(self.work / f"inductor-{self.args.size}", self.port)  # restore_bench's cache

    async def checkpoint(self) -> dict[str, Any]:
        await asyncio.to_thread(drop_caches)
        launched = time.time()
        source = await self.runtime.launch(WorkloadSpec(f"src-{KEY}", self.worker_cmd(), self.env()))
        self.ctl = source.control_dir
        await wait_ready(source, self.args.ready_timeout)
        cold = await wait_json(source.control_dir / "cold-timings.json", within=10)
        self.cold = cold
        rec: dict[str, Any] = {"cold_start_s": round(float(cold["ready_at"]) - launched, 3)}
        self.go_ahead_format = await asyncio.to_thread(restore_complete.format_for_worker, source.control_dir)
        shutil.rmtree(self.images, ignore_errors=True)
        cpu0, t0 = cpu_seconds(own=False) + helpers_cpu_seconds(), time.monotonic()
        self.cuda_pids = await asyncio.to_thread(find_cuda_pids, source.pid)
        phases: dict[str, float] = {"cuda_lock": 0.0, "cuda_checkpoint": 0.0}
        for pid in self.cuda_pids:
            phases["cuda_lock"] += await self.cuda_checkpoint("lock", pid)
        for pid in self.cuda_pids:
            phases["cuda_checkpoint"] += await self.cuda_checkpoint("checkpoint", pid)
        dumped = await self.criu.dump(
            source.pid,
            self.images,
            log_dir=self.work / "nvidia-logs",
            options=NV_TREE,
            link_remap=True,
            ghost_limit=NV_GHOST_LIMIT,
            extra_args=self.libdir(),
        )
        phases["criu_dump"] = round(dumped.seconds, 3)
        await asyncio.to_thread(os.sync)  # the images on disk before the first restore drops the cache
        rec["checkpoint_s"] = round(time.monotonic() - t0, 3)
        rec["checkpoint_phases"] = {k: round(v, 3) for k, v in phases.items()}
        rec["cuda_pids"] = len(self.cuda_pids)
        rec["artifact_bytes"] = dumped.image_bytes
        await wait_gone(source.pid)
        rec["checkpoint_cpu_all_s"] = round(cpu_seconds(own=False) + helpers_cpu_seconds() - cpu0, 3)
        return rec

    async def restore(self, n: int, *, drop: bool) -> dict[str, Any]:
        key = f"{KEY}-{n}"
        for name in ("resume.json", protocol.FILE_RESTORE_COMPLETE):
            (self.ctl / name).unlink(missing_ok=True)
        if drop:
            await asyncio.to_thread(drop_caches)
        rec: dict[str, Any] = {"cache": "dropped" if drop else "warm"}
        cpu0, t0 = cpu_seconds(own=False) + helpers_cpu_seconds(), time.time()
        logs = self.work / "nvidia-logs" / key
        restored = await self.criu.restore(
            self.images,
            log_dir=logs,
            pidfile=logs / "restore.pid",
            detach=True,
            options=NV_TREE,
            extra_args=(*NV_RESTORE_ARGS, *self.libdir()),
        )
        pid = restored.pid
        t_criu = time.time()
        phases = {"criu_restore": round(t_criu - t0, 3), "cuda_restore": 0.0, "cuda_unlock": 0.0}
        for cuda_pid in self.cuda_pids:
            phases["cuda_restore"] += await self.cuda_checkpoint("restore", cuda_pid)
        for cuda_pid in self.cuda_pids:
            phases["cuda_unlock"] += await self.cuda_checkpoint("unlock", cuda_pid)
        doc = {"node": os.uname().nodename, "restoredAt": time.time()}
        await asyncio.to_thread(restore_complete.write, self.ctl, doc, pid, self.go_ahead_format)
        rec["restore_agent_s"] = round(time.time() - t0, 3)
        done = cpu_seconds(own=False) + helpers_cpu_seconds() + tree_cpu_seconds(pid)
        rec["cpu_all_s"] = round(done - cpu0, 3)
        serving = await wait_serving(self.port, within=self.args.serve_timeout)
        rec["restore_s"] = round(serving - t0, 3)
        rec["restore_phases"] = {k: round(v, 3) for k, v in phases.items()}
        prompts, tokens = self.cold["selftest_prompts"], self.cold["selftest_tokens"]
        status, answer = await asyncio.to_thread(
            http, self.port, "/generate", {"prompts": prompts, "max_new_tokens": 1}
        )
        rec["first_token_s"] = round(time.time() - t0, 3)
        rec["first_token_identical"] = status == 200 and answer["tokens"] == [t[:1] for t in tokens]
        status, answer = await asyncio.to_thread(
            http, self.port, "/generate", {"prompts": prompts, "max_new_tokens": 16}
        )
        rec["output_identical"] = status == 200 and answer["tokens"] == tokens
        await self.kill(pid)
        return rec

    async def kill(self, pid: int) -> None:
        """The restored tree (its root leads its own process group, as the source did), until its pid is
        free again for the next restore."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        await wait_gone(pid)

    async def run(self) -> bool:
        a = self.args
        self.result["host"] = host_facts()
        self.result["criu"] = str(await self.criu.require())
        await self.prepare()
        gbps = await asyncio.to_thread(storage_gbps, self.work / "calibration.bin", a.calib_gib)
        self.result["storage_gbps"] = round(gbps, 3)
        self.result.update(await self.checkpoint())
        self.result["sol_s"] = round(self.result["artifact_bytes"] / (gbps * 1e9), 3)
        self.save()
        failures = 0
        for n in range(a.restores + a.warm):
            try:
                rec = await self.restore(n, drop=n < a.restores)
            except Exception:
                failures += 1
                rec = {"error": traceback.format_exc()[-2000:], "log": self.tail(f"{KEY}-{n}")}
                await self.kill_restored(f"{KEY}-{n}")
            self.result["restores"].append(rec)
            self.save()
        self.result["failures"] = failures
        for cache in ("dropped", "warm"):
            done = [r for r in self.result["restores"] if r.get("cache") == cache and "restore_s" in r]
            if done:
                self.result[f"restore_s_{cache}"] = spread([r["restore_s"] for r in done])
        self.save()
        return failures == 0

    def tail(self, key: str) -> str:
        """The ends of CRIU's restore log and of the worker's log."""
        logs = (self.work / "nvidia-logs" / key / "restore.log", self.ctl / "worker.log")
        ends = (f"== {log}\n{log.read_text(errors='replace')[-2000:]}" for log in logs if log.exists())
        return "\n".join(ends)

    async def kill_restored(self, key: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            await self.kill(int((self.work / "nvidia-logs" / key / "restore.pid").read_text()))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1g")
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument(
        "--criu", type=Path, required=True, help="upstream CRIU (criu-dev), as NVIDIA's image builds"
    )
    ap.add_argument("--cuda-checkpoint", type=Path, required=True, help="NVIDIA/cuda-checkpoint's binary")
    ap.add_argument("--restores", type=int, default=5, help="restores with the page cache dropped")
    ap.add_argument("--warm", type=int, default=2, help="then restores with the images in the page cache")
    ap.add_argument("--work", type=Path, default=Path("/tmp/restore-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ready-timeout", type=float, default=400)
    ap.add_argument("--serve-timeout", type=float, default=120)
    ap.add_argument("--calib-gib", type=int, default=4)
    ap.add_argument("--worker-args", default="", help="extra worker flags, e.g. for a CPU dry run")
    args = ap.parse_args()
    bench = NvidiaPath(args)
    try:
        ok = await bench.run()
    except Exception:
        bench.result["error"] = traceback.format_exc()[-3000:]
        ok = False
    finally:
        bench.save()
        await bench.runtime.stop(f"src-{KEY}")
    print(json.dumps({k: v for k, v in bench.result.items() if k != "restores"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
