"""Cold start vs restore of the compile-heavy reference worker (examples/reference_worker) on the H200,
through the project's own agent code path (ProcessRuntime + Executor: CUDA driver checkpoint API, CRIU,
artifact store), in three modes:

- plain:      the worker as it is; the CUDA checkpoint copies weights and KV cache into the CRIU image
- kv:         the KV cache is released before the checkpoint and mapped again after the restore
- decoupled:  KV released, and the weights saved beside the image, verified while CRIU restores, and
              loaded back at the same addresses by the worker

    python3 benchmarks/gpu/restore_bench.py --size 1g --out $OUT

Per size: the storage bandwidth is measured first (16 parallel O_DIRECT reads, page cache dropped); the
plain-mode worker is started with an empty torch.compile cache (`cold_start_s`: a new pod on a new node)
and the kv and decoupled workers with the cache it left (`cold_start_warm_cache_s`). Every cold start and
every restore begins with the page cache dropped. A restore ends when the worker answers /health again;
then its /generate answer is compared with the cold-started worker's. SOL = the artifact's bytes (what
the restore must read) / the measured bandwidth. Writes OUT/gpu-restore-<size>.json after every step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.agent_variants import StoppableProcessRuntime, VariantExecutor, agent_config  # noqa: E402
from benchmarks.gpu.host import (  # noqa: E402
    FileWatch,
    IoSampler,
    LoopLag,
    cpu_seconds,
    criu_log_times,
    drop_caches,
    helpers_cpu_seconds,
    host_facts,
    http,
    log_gaps,
    page_stats,
    thp_mode,
    tree_cpu_seconds,
    wait_gone,
    wait_json,
)
from benchmarks.gpu.isolated import IsolatedRuntime, NetnsHttp  # noqa: E402
from dynamo_snapshot.agent.config import AgentConfig  # noqa: E402
from dynamo_snapshot.agent.executor import AgentError  # noqa: E402
from dynamo_snapshot.agent.prefetch import PREFETCH_FILE, read_plan  # noqa: E402
from dynamo_snapshot.agent.runtime import WorkloadSpec  # noqa: E402
from dynamo_snapshot.api.identity import CheckpointIdentity, compute_identity_hash  # noqa: E402
from dynamo_snapshot.artifact import ArtifactStore, VerifiedFiles  # noqa: E402
from dynamo_snapshot.criu import Criu  # noqa: E402

WORKER = REPO / "examples" / "reference_worker" / "worker.py"
MODES = {
    "plain": [],
    # plain without the SDK's one offer to a plain worker (dropping the zero pages of the CUDA checkpoint's
    # host copy): what the agent does for a stock engine that speaks only the handshake.
    "stock": ["--no-release-zero-pages"],
    "kv": ["--release-kv"],
    "decoupled": ["--release-kv", "--decouple-weights"],
    # stock with the agent's zero-page rewrite off (MODE_SETTINGS): the A/B of its `auto` in one call.
    "stock_keep_zeros": ["--no-release-zero-pages"],
    # stock with the rewrite and the memory it empties marked for huge pages (--zero-pages-huge-advice).
    "stock_huge_advice": ["--no-release-zero-pages"],
}
# Agent settings a mode's checkpoint takes over --drop-zero-pages and --compress-pages.
MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "stock_keep_zeros": {"drop_zero_pages": "off"},
    "stock_huge_advice": {"drop_zero_pages": "auto", "zero_pages_huge_advice": True},
}
STOCK_MODES = ("stock", "stock_keep_zeros", "stock_huge_advice")
GIB = 2**30
# Diagnostic restores of an artifact (--variants-for): the agent settings each one changes, and whether it
# starts with the page cache dropped.
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": ({}, True),
    "warm_node": ({}, False),
    "no_prefetch": ({"prefetch_node_files": False}, True),
    "weights_normal_io": ({"weights_check_idle_io": False}, True),
    "weights_after": ({"weights_check_early": False}, True),
    "overlap": ({"overlap_page_check": True}, True),
    "overlap_weights_after": ({"overlap_page_check": True, "weights_check_early": False}, True),
    "lazy": ({"lazy_pages": "before_signal"}, True),
    "warm_lazy": ({"lazy_pages": "before_signal"}, False),
    "warm_lazy_after_signal": ({"lazy_pages": "after_signal"}, False),
    # The agent's CRIU filling memory 4 KiB at a time (no --restore-huge-pages).
    "small_pages": ({"restore_huge_pages": False}, True),
    "warm_small_pages": ({"restore_huge_pages": False}, False),
    # The agent's CRIU reading each process's pages with one thread (--restore-readers 1).
    "one_reader": ({"restore_readers": 1}, True),
    "warm_one_reader": ({"restore_readers": 1}, False),
    # The host's transparent huge pages on for every anonymous mapping during the restore (THP_KNOB).
    "thp": ({"thp": "always"}, True),
    "warm_thp": ({"thp": "always"}, False),
}
THP_KNOB = "thp"


def storage_gbps(path: Path, gib: int = 4, threads: int = 16, block: int = 64 << 20) -> float:
    """Read bandwidth of the disk under `path`: a file written once, read back with 16 O_DIRECT readers."""
    if not path.exists() or path.stat().st_size != gib * GIB:
        subprocess.run(
            [
                "dd",
                "if=/dev/zero",
                f"of={path}",
                "bs=64M",
                f"count={gib * 16}",
                "oflag=direct",
                "status=none",
            ],
            check=True,
        )
    drop_caches()
    import mmap

    size = path.stat().st_size

    def reader(k: int) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, block)
        done = 0
        try:
            for off in range(k * block, size, threads * block):
                done += os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
            buf.close()
        return done

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(reader, range(threads)))
    return total / (time.monotonic() - started) / 1e9


def worker_env(cache: Path, port: int) -> dict[str, str]:
    """The worker's environment beside the bench's own: this repository importable, the compile caches
    under `cache`, its port."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": pythonpath,
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "WORKER_PORT": str(port),
    }


def worker_command(args: argparse.Namespace, model_dir: Path, mode: str, port: int) -> list[str]:
    """The reference worker in `mode` (MODES), as both GPU benches start it (`args`: size, kv_gib,
    worker_args)."""
    return [
        sys.executable, str(WORKER), "--size", args.size, "--model-dir", str(model_dir),
        "--kv-gib", str(args.kv_gib), "--port", str(port), *MODES[mode], *args.worker_args.split(),
    ]  # fmt: skip


async def wait_serving(port: int, within: float) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            status, _ = await asyncio.to_thread(http, port, "/health", None, 2)
            if status == 200:
                return time.time()
        except (OSError, urllib.error.URLError):
            pass
        await asyncio.sleep(0.01)
    raise TimeoutError(f"worker on port {port} did not serve within {within}s")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work: Path = args.work
        self.criu = Criu()
        # Stopped restores: the overlap variants.
        self.runtime = StoppableProcessRuntime(self.work / "control", self.criu)
        self.store = ArtifactStore(self.work / "artifacts")
        self.executor = VariantExecutor(self.runtime, self.store, self.criu, self.agent_config())
        self.result: dict[str, Any] = {
            "size": args.size,
            "kv_gib": args.kv_gib,
            "compress_pages": args.compress_pages,
            "drop_zero_pages": args.drop_zero_pages,
            "modes": {},
        }
        tag = f"-{args.tag}" if args.tag else ""
        self.out = args.out / f"gpu-restore-{args.size}{tag}.json"

    def agent_config(self) -> AgentConfig:
        return agent_config(
            compress_pages=self.args.compress_pages == "on", drop_zero_pages=self.args.drop_zero_pages
        )

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=1))

    def logs(self, mode: str) -> dict[str, str]:
        """The last lines of the worker's and CRIU's logs, to see why a mode failed."""
        out = {}
        for key in (f"src-{mode}", f"restored-{mode}"):
            d = self.runtime.control_dir(key)
            for log in sorted(d.glob("*.log")) if d.exists() else []:
                out[f"{key}/{log.name}"] = log.read_text(errors="replace")[-3000:]
        return out

    def worker_cmd(self, mode: str, port: int) -> list[str]:
        return worker_command(self.args, self.model_dir, mode, port)

    @property
    def model_dir(self) -> Path:
        return self.work / "models" / self.args.size

    async def prepare(self) -> None:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.worker_cmd("plain", 0),
            "--prepare-only",
            env={**os.environ, **worker_env(self.work / "inductor-prepare", 0)},
        )
        if await proc.wait() != 0:
            raise RuntimeError("preparing the model failed")
        self.result["prepare_s"] = round(time.monotonic() - started, 2)
        files = list(self.model_dir.glob("*.safetensors"))
        self.result["model_bytes"] = sum(f.stat().st_size for f in files)
        gbps = await asyncio.to_thread(storage_gbps, self.work / "calibration.bin", self.args.calib_gib)
        self.result["storage_gbps"] = round(gbps, 3)
        self.result["host"] = host_facts()
        self.save()

    async def run_mode(self, mode: str, cache: Path, port: int) -> None:
        rec: dict[str, Any] = {"mode": mode}
        self.result["modes"][mode] = rec
        ident = CheckpointIdentity.model_validate(
            {"model": f"reference-worker/{self.args.size}-{mode}", "backendFramework": "vllm"}
        )
        ident_hash = compute_identity_hash(ident)
        await asyncio.to_thread(drop_caches)
        launched = time.time()
        source = await self.runtime.launch(
            WorkloadSpec(f"src-{mode}", self.worker_cmd(mode, port), worker_env(cache, port))
        )
        await self.executor.wait_ready(source, within=self.args.ready_timeout)
        cold = await wait_json(source.control_dir / "cold-timings.json", within=10)
        rec["cold_start_s"] = round(float(cold["ready_at"]) - launched, 3)
        rec["cold_timings"] = cold
        self.save()

        cpu0 = cpu_seconds() + helpers_cpu_seconds()
        settings = self.executor.config.checkpoint
        chosen = self.agent_config().checkpoint.model_copy(update=MODE_SETTINGS.get(mode, {}))
        rec["drop_zero_pages"] = settings.drop_zero_pages = chosen.drop_zero_pages
        rec["zero_pages_huge_advice"] = settings.zero_pages_huge_advice = chosen.zero_pages_huge_advice
        settings.compress_pages = chosen.compress_pages
        ckpt = await self.executor.checkpoint(source, ident_hash, ident)
        rec["checkpoint_cpu_all_s"] = round(cpu_seconds() + helpers_cpu_seconds() - cpu0, 3)
        rec["checkpoint_phases"] = ckpt.timings.phases
        rec["checkpoint_s"] = ckpt.timings.total()
        rec["artifact_bytes"] = ckpt.artifact_bytes
        manifest = self.store.open(ident_hash).manifest
        rec["artifact_files"] = {f.path: f.size for f in manifest.files if f.size > 64 << 20}
        rec["gpu_memory"] = manifest.extra.get("gpuMemory")
        dropped = manifest.extra.get("zeroPagesDropped")
        rec["zero_pages_dropped_bytes"] = dropped * 4096 if isinstance(dropped, int) else None
        rec["zero_page_bytes_released"] = manifest.extra.get("zeroPageBytesReleased")
        rec["zero_page_release_worker"] = manifest.extra.get("zeroPageReleaseWorker")
        rec["pages_compressed"] = manifest.extra.get("pagesCompressed")
        weights_files = [w for w in manifest.files if w.path.startswith("weights/")]
        rec["weights_stored_bytes"] = sum(w.size for w in weights_files)
        plan = self.store.open(ident_hash).path / PREFETCH_FILE
        if plan.exists():
            p = read_plan(plan)
            rec["prefetch_plan"] = {"files": len(p.files), "bytes": p.bytes, "unresolved": p.unresolved}
        # plain and stock images are mostly the GPU's copy of weights and KV cache
        if mode not in ("plain", *STOCK_MODES):
            pages = sorted((self.store.open(ident_hash).path / "criu").glob("pages-*.img"))
            rec["pages_stats"] = {p.name: await asyncio.to_thread(page_stats, p) for p in pages}
        memory_report = source.control_dir / "checkpoint-memory.json"
        if memory_report.exists():
            rec["checkpoint_memory"] = json.loads(memory_report.read_text())
        self.save()
        shutil.rmtree(source.control_dir, ignore_errors=True)  # a new node: nothing of the source left

        rec["sol_s"] = round(ckpt.artifact_bytes / (self.result["storage_gbps"] * 1e9), 3)
        rec.update(await self.timed_restore(f"restored-{mode}", ident_hash, port, cold))
        rec["restore_over_sol"] = round(rec["restore_s"] / rec["sol_s"], 3)
        self.save()
        if self.args.warm_restore:  # the same restore again on this node, the artifact in the page cache
            await self.stop_and_wait(f"restored-{mode}")
            warm_key = f"restored-{mode}-warm"
            rec["warm_restore"] = await self.timed_restore(warm_key, ident_hash, port, cold, drop=False)
            await self.stop_and_wait(warm_key)
            self.save()
        if self.args.variants and mode in self.args.variants_for:
            rec["diagnostics"] = await self.diagnostics(f"restored-{mode}", ident_hash, port, cold)
            self.save()
        if mode == "decoupled" and self.args.burst:
            await self.stop_and_wait(f"restored-{mode}")
            rec["burst"] = await self.burst(ident_hash, port, cold)
            self.save()
        if mode == "decoupled" and self.args.bad_inputs:
            rec["bad_inputs"] = await self.bad_inputs(f"restored-{mode}", ident_hash)
        await self.runtime.stop(f"restored-{mode}")
        if mode != "decoupled" or not self.args.keep_artifacts:
            await asyncio.to_thread(shutil.rmtree, self.store.path_for(ident_hash), True)
        self.save()

    async def timed_restore(
        self, key: str, ident_hash: str, port: int, cold: dict[str, Any], *, drop: bool = True
    ) -> dict[str, Any]:
        """One restore, from the agent's call to the worker answering /health, and its /generate answer
        compared with the cold-started worker's; the disk reads during it sampled."""
        rec: dict[str, Any] = {}
        # Restores of one artifact share the source's control dir: the worker's last answer must go.
        source_ctl = self.store.open(ident_hash).manifest.extra["control_dir"]
        assert isinstance(source_ctl, str)
        (Path(source_ctl) / "resume.json").unlink(missing_ok=True)
        if drop:
            await asyncio.to_thread(drop_caches)
        t0 = time.time()
        criu_log = FileWatch(self.runtime.control_dir(key) / "restore.log")
        with IoSampler() as io, criu_log:
            cpu0 = await asyncio.to_thread(lambda: cpu_seconds() + helpers_cpu_seconds())
            async with LoopLag() as lag:
                restored = await self.executor.restore(key, ident_hash)
            t_agent = time.time()
            pid = restored.workload.pid
            done = await asyncio.to_thread(
                lambda: cpu_seconds() + helpers_cpu_seconds() + tree_cpu_seconds(pid)
            )
            rec["cpu_all_s"] = round(done - cpu0, 3)
            serving = await wait_serving(port, within=self.args.serve_timeout)
        rec["criu_log_times"] = criu_log_times(criu_log, t0, restored.timings.phases)
        rec["criu_log_gaps"] = log_gaps(self.runtime.control_dir(key) / "restore.log")
        rec["loop_lag"] = lag.to_dict()
        rec["restore_s"] = round(serving - t0, 3)
        rec["restore_agent_s"] = round(t_agent - t0, 3)
        rec["restore_phases"] = restored.timings.phases
        rec["restore_overlapped"] = restored.timings.overlapped
        if restored.prefetch is not None:
            rec["prefetch"] = dataclasses.asdict(restored.prefetch)
        timeline = io.timeline(t0)
        rec["disk_read_mb"] = timeline[-1][1] if timeline else None
        rec["io_timeline"] = timeline
        # The first token of every self-test prompt, then their whole answers (16 tokens each).
        status, answer = await asyncio.to_thread(
            http, port, "/generate", {"prompts": cold["selftest_prompts"], "max_new_tokens": 1}
        )
        rec["first_token_s"] = round(time.time() - t0, 3)
        first_tokens = [tokens[:1] for tokens in cold["selftest_tokens"]]
        rec["first_token_identical"] = status == 200 and answer["tokens"] == first_tokens
        status, answer = await asyncio.to_thread(
            http, port, "/generate", {"prompts": cold["selftest_prompts"], "max_new_tokens": 16}
        )
        rec["output_identical"] = status == 200 and answer["tokens"] == cold["selftest_tokens"]
        rec["first_answer_s"] = round(time.time() - t0, 3)  # the self-test prompts answered
        resume = await wait_json(restored.workload.control_dir / "resume.json", within=60)
        rec["resume"] = resume
        rec["resumed_after_s"] = round(float(resume["resumed_at"]) - t0, 3)
        self.keep_criu_log(key)
        return rec

    def keep_criu_log(self, key: str, d: Path | None = None, under: str = "criu-logs") -> None:
        """CRIU's restore log (timestamped, -v4) and stats of workload `key` (its control dir `d`),
        gzipped under OUT/`under`/."""
        d = d or self.runtime.control_dir(key)
        dest = self.args.out / under
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("restore.log", "stats-restore"):
            src = d / name
            if src.exists():
                with gzip.open(dest / f"{self.args.size}-{key}-{name}.gz", "wb") as f:
                    f.write(src.read_bytes())

    async def diagnostics(self, key: str, ident_hash: str, port: int, cold: dict[str, Any]) -> dict[str, Any]:
        """Other restores of the same artifact, one per variant (`--variants`): each changes some of the
        agent's settings (VARIANTS) and starts with the page cache dropped and nothing verified, except
        `warm_node`, the second restore on a node (page cache and verify cache warm). A variant named
        again is kept as `name#2`, `name#3`..."""
        out: dict[str, Any] = {}
        ex = self.executor
        base = key
        for n, name in enumerate(self.args.variants):
            knobs, drop = VARIANTS[name]
            knobs = dict(knobs)
            thp = knobs.pop(THP_KNOB, None)
            label = name if name not in out else f"{name}#{self.args.variants[: n + 1].count(name)}"
            await self.stop_and_wait(key)
            key = f"{base}-{n}-{name}"
            saved = {attr: getattr(ex, attr) for attr in (*knobs, "verified")}
            if drop:
                ex.verified = VerifiedFiles(ttl_s=3600)  # a node that has not checked this artifact yet
            for attr, value in knobs.items():
                setattr(ex, attr, value)
            try:
                with thp_mode(thp):
                    out[label] = await self.timed_restore(key, ident_hash, port, cold, drop=drop)
            except Exception:
                out[label] = {"error": traceback.format_exc()[-2000:]}
            finally:
                for attr, value in saved.items():
                    setattr(ex, attr, value)
            self.save()
        await self.stop_and_wait(key)
        return out

    async def burst(self, ident_hash: str, port: int, cold: dict[str, Any]) -> dict[str, Any]:
        """One restore into namespaces of its own (isolated.IsolatedRuntime), then `--burst` of them
        started together; each time the page cache is dropped first and the placeholders run already.
        How much longer the last of the burst takes to serve than one alone; each copy's /generate
        answer compared with the cold worker's."""
        runtime = IsolatedRuntime(self.work / "isolated", self.criu)
        ex = VariantExecutor(runtime, self.store, self.criu, self.agent_config())
        for attr, value in VARIANTS[self.args.burst_variant][0].items():
            if attr != THP_KNOB:
                setattr(ex, attr, value)
        out: dict[str, Any] = {"variant": self.args.burst_variant}

        async def one(key: str, t0: float) -> dict[str, Any]:
            rec: dict[str, Any] = {}
            try:
                restored = await ex.restore(key, ident_hash)
                rec["restore_agent_s"] = round(time.time() - t0, 3)
                rec["restore_phases"] = restored.timings.phases
                rec["criu_log_gaps"] = log_gaps(runtime.control_dir(key) / "restore.log")
                rec["restore_overlapped"] = restored.timings.overlapped
                client = NetnsHttp(runtime.netns(key))
                try:
                    served = await client.wait_serving(port, self.args.serve_timeout, restored.workload.pid)
                    rec["restore_s"] = round(served - t0, 3)
                    status, answer = await client.call(
                        port, "/generate", {"prompts": cold["selftest_prompts"], "max_new_tokens": 16}
                    )
                finally:
                    client.close()
                rec["output_identical"] = status == 200 and answer["tokens"] == cold["selftest_tokens"]
                rec["first_answer_s"] = round(time.time() - t0, 3)
            except Exception:
                rec["error"] = traceback.format_exc()[-2000:]
                # Why the worker did not serve: the end of what it wrote.
                log = runtime.control_dir(key) / "worker.log"
                with contextlib.suppress(OSError):
                    rec["worker_log"] = log.read_text(errors="replace")[-3000:]
            return rec

        async def together(n: int, name: str) -> dict[str, Any]:
            source_ctl = self.store.open(ident_hash).manifest.extra["control_dir"]
            assert isinstance(source_ctl, str)
            for i in range(n):
                await runtime.prepare(f"{name}-{i}", Path(source_ctl))
            ex.verified = VerifiedFiles(ttl_s=3600)
            await asyncio.to_thread(drop_caches)
            t0 = time.time()
            with IoSampler() as io:
                copies = await asyncio.gather(*(one(f"{name}-{i}", t0) for i in range(n)))
            timeline = io.timeline(t0)
            for i in range(n):
                self.keep_criu_log(f"{name}-{i}", runtime.control_dir(f"{name}-{i}"), "burst-logs")
            served = [c["restore_s"] for c in copies if "restore_s" in c]
            rec = {
                "copies": copies,
                "all_serving_s": max(served) if len(served) == n else None,
                "disk_read_mb": timeline[-1][1] if timeline else None,
            }
            for i in range(n):
                await runtime.stop(f"{name}-{i}")
            self.save()
            return rec

        try:
            with thp_mode(VARIANTS[self.args.burst_variant][0].get(THP_KNOB)):
                out["alone"] = await together(1, "alone")
                self.save()
                out["burst"] = await together(self.args.burst, "burst")
            alone, burst = out["alone"]["all_serving_s"], out["burst"]["all_serving_s"]
            if alone and burst:
                out["burst_over_alone"] = round(burst / alone, 3)
        finally:
            for key in list(runtime.placeholders):
                await runtime.stop(key)
        return out

    async def stop_and_wait(self, key: str, within: float = 15) -> None:
        """Stop a restored worker and wait until its pid is free again (a zombie keeps it): the next
        restore of the same checkpoint needs that very pid."""
        found = await self.runtime.find(key)
        await self.runtime.stop(key)
        if found is not None:
            await wait_gone(found.pid, within)

    async def bad_inputs(self, running_key: str, ident_hash: str) -> dict[str, str]:
        """A restore onto a GPU without room, and from a truncated weights file: both refused."""
        out: dict[str, str] = {}
        await self.runtime.stop(running_key)
        need = self.store.open(ident_hash).manifest.extra["gpuMemory"]
        assert isinstance(need, dict)
        # Leave half of what the restore needs free on the GPU.
        hog = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import sys, torch, time\n"
            "free, _ = torch.cuda.mem_get_info()\n"
            f"keep = {int(need['heldMiB']) + int(need['releasedMiB'])} * 2**20 // 2\n"
            "x = torch.empty(max(free - keep, 0), dtype=torch.uint8, device='cuda')\n"
            "print('hogging', flush=True)\n"
            "time.sleep(600)\n",
            stdout=asyncio.subprocess.PIPE,
        )
        assert hog.stdout is not None
        await asyncio.wait_for(hog.stdout.readline(), 120)
        try:
            await self.executor.restore("bad-memory", ident_hash)
            out["too_little_gpu_memory"] = "NOT REFUSED"
        except AgentError as e:
            out["too_little_gpu_memory"] = str(e)
        finally:
            hog.kill()
            await hog.wait()
            await self.runtime.stop("bad-memory")
        artifact = self.store.path_for(ident_hash)
        weights = sorted((artifact / "weights").iterdir())
        with weights[0].open("r+b") as f:
            f.truncate(weights[0].stat().st_size - 4096)
        try:
            await self.executor.restore("bad-weights", ident_hash)
            out["truncated_weights"] = "NOT REFUSED"
        except AgentError as e:
            out["truncated_weights"] = str(e)
        finally:
            await self.runtime.stop("bad-weights")
        return out


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1g")
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--modes", default="plain,kv,decoupled")
    ap.add_argument("--work", type=Path, default=Path("/tmp/restore-bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ready-timeout", type=float, default=400)
    ap.add_argument("--no-bad-inputs", dest="bad_inputs", action="store_false")
    ap.add_argument(
        "--variants",
        default="warm_node,no_prefetch,weights_normal_io",
        help=f"extra restores of the --variants-for artifacts, comma-separated, of: {', '.join(VARIANTS)} "
        "('' for none)",
    )
    ap.add_argument("--variants-for", default="decoupled", help="modes whose artifacts --variants restore")
    ap.add_argument("--no-diagnostics", dest="variants", action="store_const", const="", help="--variants ''")
    ap.add_argument(
        "--burst", type=int, default=0, help="then restore the decoupled artifact this many times at once"
    )
    ap.add_argument(
        "--burst-variant", default="default", choices=sorted(VARIANTS), help="the burst's agent settings"
    )
    ap.add_argument("--keep-artifacts", action="store_true")
    ap.add_argument("--serve-timeout", type=float, default=120, help="restore to serving, at most")
    ap.add_argument("--calib-gib", type=int, default=4, help="size of the bandwidth calibration file")
    ap.add_argument("--worker-args", default="", help="extra worker flags, e.g. for a CPU dry run")
    ap.add_argument(
        "--compress-pages", choices=("on", "off"), default="off", help="the agent's --compress-pages"
    )
    ap.add_argument(
        "--drop-zero-pages",
        choices=("auto", "on", "off"),
        default="auto",
        help="the agent's --drop-zero-pages (a mode in MODE_SETTINGS may set its own)",
    )
    ap.add_argument("--tag", default="", help="added to the result file's name (A/B runs)")
    ap.add_argument(
        "--warm-restore", action="store_true", help="restore each mode again with the page cache warm"
    )
    ap.add_argument(
        "--keep-compile-cache",
        action="store_true",
        help="keep the torch.compile cache an earlier run left (the plain mode's cold start is then warm)",
    )
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    args.variants_for = args.variants_for.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    # Artifacts of an earlier run would be reused (same identity hash): every run checkpoints anew.
    shutil.rmtree(args.work / "artifacts", ignore_errors=True)
    shutil.rmtree(args.work / "control", ignore_errors=True)
    bench = Bench(args)
    await bench.criu.require()
    failed = False
    try:
        await bench.prepare()
        empty_cache = args.work / f"inductor-{args.size}"
        if not args.keep_compile_cache:
            shutil.rmtree(empty_cache, ignore_errors=True)  # the first worker compiles from nothing
        for i, mode in enumerate(args.modes.split(",")):
            try:
                await bench.run_mode(mode, empty_cache, 18000 + i)
            except Exception:
                failed = True
                rec = bench.result["modes"].setdefault(mode, {})
                rec["error"] = traceback.format_exc()[-3000:]
                rec["logs"] = bench.logs(mode)
                bench.save()
                for key in (f"src-{mode}", f"restored-{mode}"):
                    await bench.runtime.stop(key)
    finally:
        bench.save()
    print(json.dumps(bench.result, indent=1)[-6000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
