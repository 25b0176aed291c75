"""A compile-heavy reference inference worker: what an inference engine does at start-up, on a
Qwen3-style decoder with random weights, so that cold start and restore can be compared honestly.

Cold start (each phase timed): import torch and transformers; create the CUDA context; build the
model on the meta device and load its safetensors onto the GPU; optionally pack the weights into one
VMM region (--decouple-weights); carve a KV cache out of one VMM region; torch.compile a hand-written
decode step (vLLM style: static shapes, KV written in place, attention over the whole cache row under
a mask) for every batch size; capture one CUDA graph per batch size; run a self-test. Then it serves
greedy generation over HTTP (/generate, /health, /metrics) and, in a snapshot-enabled pod
(SNAPSHOT_CONTROL_DIR), goes through the checkpoint handshake first, releasing KV cache and weights
when asked, and proves after the resume that it computes the same tokens.

    python examples/reference_worker/worker.py --size 8g --decouple-weights --release-kv
    python examples/reference_worker/worker.py --size tiny --device cpu --no-compile --no-graphs

See README.md beside this file for the flags and the files it writes.
"""

from __future__ import annotations

import time

_STARTED_AT = time.time()  # process start, as far as Python code can see it
_STARTED = time.monotonic()

if __name__ == "__main__":
    # A restore pod's container on a kubelet node: wait as its placeholder for the node agent's restore,
    # before torch is imported (that import alone is seconds of every restore).
    from dynamo_snapshot.workload.standby import run_standby, standby_requested

    if standby_requested():
        raise SystemExit(run_standby())

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from http import HTTPStatus  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from pathlib import Path  # noqa: E402
from socketserver import TCPServer  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import TYPE_CHECKING, Any, NoReturn  # noqa: E402

# Timed: importing the frameworks is part of every cold start.
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

if TYPE_CHECKING:
    from dynamo_snapshot.workload import KvCache, SnapshotHandshake, WeightRegion


def _import_sdk() -> tuple[ModuleType | None, str | None]:
    """The snapshot SDK, or None and why: without it the worker still runs, just not in a snapshot pod."""
    try:
        return importlib.import_module("dynamo_snapshot.workload"), None
    except ModuleNotFoundError as e:
        if e.name != "dynamo_snapshot":
            return None, str(e)
    # Run from a checkout without the package installed: the repository root is two levels up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        return importlib.import_module("dynamo_snapshot.workload"), None
    except ImportError as e:
        return None, str(e)


snapshot_sdk, _SDK_ERROR = _import_sdk()
# The control directory variables (dynamo_snapshot.api.protocol), to tell a snapshot pod without the SDK.
_CONTROL_DIR_ENVS = ("SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")

_IMPORTED = time.monotonic()

log = logging.getLogger("reference_worker")

PROG = "reference-worker"
WEIGHTS_FILE_NAME = "model.safetensors"
DEFAULT_MODELS_ROOT = Path("/tmp/reference-worker-models")
COLD_TIMINGS_FILE = "cold-timings.json"
RESUME_FILE = "resume.json"
CHECKPOINT_MEMORY_FILE = "checkpoint-memory.json"
SELFTEST_NEW_TOKENS = 16
MAX_BODY_BYTES = 16 << 20
# Every KV tensor is this many positions long at least: the self-test's prompts and new tokens fit.
MIN_SEQ = 64

# ---- model presets ---------------------------------------------------------------------------------

# The decoder shapes of the published Qwen3 models, so that compile time (which grows with the number
# of layers torch.compile traces) is what an engine serving such a model pays: 1g has Qwen3-0.6B's 28
# layers (with a 32k vocabulary and an untied head: 0.95 GiB), 4g is Qwen3-1.7B, 8g Qwen3-4B and 16g
# Qwen3-8B (151,936-token vocabulary, untied heads, so that every tensor is stored once).
_QWEN3_VOCAB = 151936
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "1g": dict(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "4g": dict(
        vocab_size=_QWEN3_VOCAB,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "8g": dict(
        vocab_size=_QWEN3_VOCAB,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "16g": dict(
        vocab_size=_QWEN3_VOCAB,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
# Nominal bf16 weight bytes of each preset (the tests hold the presets to these, within 15%).
NOMINAL_BYTES: dict[str, int] = {
    "tiny": 5 << 20,
    "1g": 1 << 30,
    "4g": 4 << 30,
    "8g": 8 << 30,
    "16g": 16 << 30,
}
# Fields a model directory's config.json must agree on with its preset.
_CONFIG_KEYS = (*PRESETS["tiny"].keys(), "tie_word_embeddings")
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class WorkerError(Exception):
    """A problem the user can fix (bad flag, missing GPU, ...): one line, exit code 2."""


def sdk() -> ModuleType:
    """dynamo_snapshot.workload; WorkerError when it does not import (pydantic missing, ...)."""
    if snapshot_sdk is None:
        raise WorkerError(f"the snapshot SDK (dynamo_snapshot.workload) does not import: {_SDK_ERROR}")
    return snapshot_sdk


def make_config(size: str) -> Qwen3Config:
    if size not in PRESETS:
        raise WorkerError(f"unknown --size {size!r} (choose from {', '.join(PRESETS)})")
    return Qwen3Config(
        **PRESETS[size],
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        initializer_range=0.02,
    )


def head_dim_of(config: Qwen3Config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def rope_theta_of(config: Qwen3Config) -> float:
    """rope_theta, wherever this transformers version keeps it (v5 moved it into rope_parameters)."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(config, name, None)
            if isinstance(params, dict) and params.get("rope_theta") is not None:
                theta = params["rope_theta"]
                break
    return float(theta if theta is not None else 1_000_000.0)


def meta_model(config: Qwen3Config) -> Qwen3ForCausalLM:
    """The model with no storage: shapes and names only."""
    with torch.device("meta"):
        return Qwen3ForCausalLM(config)


def parameter_count(config: Qwen3Config) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


# ---- preparing the model directory (not part of the timed cold start) ----------------------------


def default_model_dir(size: str) -> Path:
    return DEFAULT_MODELS_ROOT / size


def model_ready(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / WEIGHTS_FILE_NAME).is_file()


def prepare_model(size: str, model_dir: Path, *, device: str = "cpu", seed: int = 0) -> Path:
    """Random weights for the preset (fixed seed), saved once as bf16 safetensors with config.json.

    Made in a directory beside `model_dir` and renamed into place, so a model directory is complete
    or absent. Initialised on `device` (the GPU is much faster for the big sizes)."""
    from safetensors.torch import save_file

    if model_ready(model_dir):
        return model_dir
    config = make_config(size)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(f".{model_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        tensors: dict[str, torch.Tensor] = {}
        for name, p in meta_model(config).named_parameters():
            t = torch.empty(
                tuple(p.shape), dtype=torch.float32 if dev.type == "cpu" else torch.bfloat16, device=dev
            )
            if name.endswith("norm.weight"):
                # Not all ones: a norm whose weight is skipped or misapplied must change the tokens.
                t.normal_(1.0, 0.1, generator=gen)
            else:
                t.normal_(0.0, config.initializer_range, generator=gen)
            tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
        save_file(tensors, str(tmp / WEIGHTS_FILE_NAME), metadata={"format": "pt", "size": size})
        config.to_json_file(str(tmp / "config.json"))
        try:
            os.rename(tmp, model_dir)
        except OSError:
            if not model_ready(model_dir):  # not another process that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def check_model_dir(model_dir: Path, size: str) -> Qwen3Config:
    config = Qwen3Config.from_pretrained(str(model_dir))
    want = make_config(size)
    diff = [k for k in _CONFIG_KEYS if getattr(config, k, None) != getattr(want, k, None)]
    if diff:
        raise WorkerError(
            f"{model_dir} holds another model than --size {size} ({', '.join(diff)} differ): remove it"
        )
    return config


# ---- loading ---------------------------------------------------------------------------------------


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """Build the model without initialising it (meta device, then uninitialised storage on `device`)
    and fill its parameters from the safetensors file, tensor by tensor, as an engine's loader does."""
    from safetensors import safe_open

    config = Qwen3Config.from_pretrained(str(model_dir))
    model = meta_model(config).to(dtype=dtype)
    model.to_empty(device=device)
    model.eval()
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    load_device = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
    with safe_open(str(model_dir / WEIGHTS_FILE_NAME), framework="pt", device=load_device) as f:
        names = set(f.keys())
        if names != set(params):
            missing, extra = sorted(set(params) - names), sorted(names - set(params))
            raise WorkerError(
                f"{model_dir}: weights do not match the model (missing {missing}, extra {extra})"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(f.get_tensor(name))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model


# ---- the KV cache ----------------------------------------------------------------------------------


@dataclasses.dataclass
class KvLayout:
    layers: int
    max_batch: int
    max_seq: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.max_batch, self.max_seq, self.kv_heads, self.head_dim)

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def slots(self) -> int:
        return self.max_batch * self.max_seq


def plan_kv(
    config: Qwen3Config, kv_bytes: int, max_batch: int, dtype: torch.dtype, cap: int, align: int = 256
) -> KvLayout:
    """As many positions per sequence as the per-layer K and V tensors of `max_batch` rows fit in
    `kv_bytes` (each tensor 256-byte aligned), capped at `cap`, a multiple of 16."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_heads, hd, layers = config.num_key_value_heads, head_dim_of(config), config.num_hidden_layers
    per_position = max_batch * kv_heads * hd * itemsize
    tensors = 2 * layers
    seq = max(0, (kv_bytes - tensors * align) // (tensors * per_position))
    seq = min(seq, cap) // 16 * 16
    if seq < MIN_SEQ:
        raise WorkerError(
            f"the KV cache ({kv_bytes / 2**30:.3g} GiB) holds only {seq} positions for {max_batch} sequences "
            f"of {layers} layers; at least {MIN_SEQ} are needed: raise --kv-gib or lower --batch-sizes"
        )
    return KvLayout(layers, max_batch, seq, kv_heads, hd, dtype)


class KvStore:
    """Per-layer K and V tensors [max_batch, max_seq, kv_heads, head_dim]: views of one KvCache (VMM)
    region on CUDA, or plain tensors (CPU, or CUDA without cuda-python)."""

    def __init__(self, layout: KvLayout, device: torch.device, *, vmm: bool, kv_bytes: int) -> None:
        self.layout = layout
        self.cache: KvCache | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        if vmm:
            self.cache = sdk().KvCache(kv_bytes, device=device.index or 0)
            for i in range(layout.layers):
                self.k.append(self.cache.allocate(f"k{i}", layout.shape, layout.dtype))
                self.v.append(self.cache.allocate(f"v{i}", layout.shape, layout.dtype))
        else:
            # Separate tensors, not views of one: inputs that alias each other cost torch.compile extra work.
            for _ in range(layout.layers):
                self.k.append(torch.zeros(layout.shape, dtype=layout.dtype, device=device))
                self.v.append(torch.zeros(layout.shape, dtype=layout.dtype, device=device))
        self.zero()

    @property
    def nbytes(self) -> int:
        if self.cache is not None:
            return self.cache.size
        return 2 * self.layout.layers * self.layout.tensor_bytes

    def zero(self) -> None:
        """Every slot 0: masked-out slots then hold finite values, which weigh exactly 0 in attention."""
        if self.cache is not None and not self.cache.released:
            self.cache.region.zero()
            return
        with torch.no_grad():
            for t in (*self.k, *self.v):
                t.zero_()


# ---- the decode step -------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(max_seq: int, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin [max_seq, head_dim] as HF's default rotary embedding computes them (float32, cast)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DecodeModel(torch.nn.Module):
    """One decode step of a Qwen3 decoder over a static KV cache, on the HF model's own modules.

    tokens [B] int64 and positions [B] int64 in, the greedy next tokens [B] out. Each layer writes its
    K and V at [b, positions[b]] and attends over the whole cache row under an additive mask that
    hides positions > positions[b]. Static shapes, no host syncs, no data-dependent control flow: it
    compiles with fullgraph=True and replays as a CUDA graph.

    GQA: the query heads that share a KV head are folded into SDPA's query-length dimension
    ([B, kv_heads, group, head_dim] against [B, kv_heads, S, head_dim]), so K and V are never repeated
    and the memory-efficient kernel (which takes a mask) can run. Query head h uses KV head
    h // group, as HF's repeat_kv does.
    """

    def __init__(self, model: Qwen3ForCausalLM, kv: KvStore) -> None:
        super().__init__()
        config = model.config
        self.embed_tokens = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = head_dim_of(config)
        self.group = self.num_heads // self.num_kv_heads
        self.max_seq = kv.layout.max_seq
        # Plain attributes, not buffers: nothing of the cache belongs to the module's state.
        self.k_cache = list(kv.k)
        self.v_cache = list(kv.v)
        dtype = kv.layout.dtype
        device = kv.k[0].device
        cos, sin = rope_tables(self.max_seq, self.head_dim, rope_theta_of(config), dtype)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.register_buffer("seq", torch.arange(self.max_seq, device=device), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        h = self.embed_tokens(tokens)  # [B, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [B, 1, D]: broadcast over heads
        sin = self.sin[positions].unsqueeze(1)
        visible = self.seq.unsqueeze(0) <= positions.unsqueeze(1)  # [B, S]
        zero = torch.zeros((), dtype=h.dtype, device=h.device)
        ninf = torch.full((), float("-inf"), dtype=h.dtype, device=h.device)
        mask = torch.where(visible, zero, ninf)[:, None, None, :]  # [B, 1, 1, S]
        rows = torch.arange(b, device=tokens.device)
        for layer, k_all, v_all in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(b, self.num_heads, self.head_dim))
            k = attn.k_norm(attn.k_proj(x).view(b, self.num_kv_heads, self.head_dim))
            v = attn.v_proj(x).view(b, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            # Written into the whole cache tensor, not into a slice of it: inductor turns index_put_
            # on a graph input back into an in-place scatter, but a write through a slice of an input
            # becomes a copy of the entire cache on every step.
            k_all.index_put_((rows, positions), k)
            v_all.index_put_((rows, positions), v)
            o = F.scaled_dot_product_attention(
                q.view(b, self.num_kv_heads, self.group, self.head_dim),
                k_all[:b].transpose(1, 2),  # this batch's rows: [B, kv_heads, S, D]
                v_all[:b].transpose(1, 2),
                attn_mask=mask,
            )
            h = h + attn.o_proj(o.reshape(b, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(h))
        return torch.argmax(logits, dim=-1)


@dataclasses.dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    out: torch.Tensor


def _raise_recompile_limit(n: int) -> None:
    """One compiled graph per batch size: more recompiles than dynamo's default limit (8) may be needed."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(int(getattr(config, name)), n + 4))


def shutdown_compile_workers() -> bool:
    """Stop inductor's compile worker processes (the checkpoint must not hold stray helpers)."""
    try:
        from torch._inductor import async_compile
    except ImportError:
        return False
    stop = getattr(async_compile, "shutdown_compile_workers", None)
    if stop is None:
        return False
    try:
        stop()
    except Exception as e:  # an internal API: never fatal
        log.warning("shutting down inductor compile workers failed: %s", e)
        return False
    return True


def child_pids() -> list[int]:
    """This process's children (all threads), from /proc."""
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (task / "children").read_text().split())
    return sorted(pids)


_SMAPS_TOTALS = {"Rss": "rss_kib", "Anonymous": "anonymous_kib", "Private_Dirty": "private_dirty_kib"}


def host_memory_report(top: int = 12) -> dict[str, Any]:
    """What CRIU will copy of this process: its anonymous and private dirty memory, by mapping name
    (the largest first), from /proc/self/smaps. Linux only; empty elsewhere."""
    by_name: dict[str, int] = {}
    totals = {"rss_kib": 0, "anonymous_kib": 0, "private_dirty_kib": 0, "mappings": 0}
    name = ""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        key, _, rest = line.partition(":")
        if not rest or " " in key:  # a mapping's header line: "start-end perms offset dev inode [name]"
            fields = line.split(None, 5)
            name = fields[5].strip() if len(fields) > 5 else "[anon]"
            totals["mappings"] += 1
            continue
        if key in _SMAPS_TOTALS:
            kib = int(rest.split()[0])
            totals[_SMAPS_TOTALS[key]] += kib
            if key == "Private_Dirty":
                by_name[name] = by_name.get(name, 0) + kib
    largest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {**totals, "private_dirty_by_mapping_kib": dict(largest)}


def gpu_memory_report(device: torch.device) -> dict[str, Any]:
    """torch's share of the GPU memory this process holds, and what the GPU has free: the rest of the
    process's NVML figure is the CUDA context's own."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    report: dict[str, Any] = {
        "torch_allocated_bytes": torch.cuda.memory_allocated(device),
        "torch_reserved_bytes": torch.cuda.memory_reserved(device),
        "torch_segments": stats.get("segment.all.current", 0),
        "gpu_free_bytes": free,
        "gpu_total_bytes": total,
    }
    with contextlib.suppress(OSError, AttributeError):
        libcuda = ctypes.CDLL("libcuda.so.1")
        for limit, label in ((0, "stack_size"), (1, "printf_fifo_size"), (2, "malloc_heap_size")):
            value = ctypes.c_size_t()
            if libcuda.cuCtxGetLimit(ctypes.byref(value), limit) == 0:
                report[f"limit_{label}"] = value.value
    return report


# ---- the engine ------------------------------------------------------------------------------------


class Engine:
    """Greedy batched generation over the decode step; one batch at a time (`lock`)."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        kv: KvStore,
        batch_sizes: Sequence[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.vocab_size = int(model.config.vocab_size)
        self.decode = DecodeModel(model, kv)
        self.step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.decode
        self.graphs: dict[int, CapturedStep] = {}
        self.compiled = False
        self.fullgraph: bool | None = None
        self.region: WeightRegion | None = None  # the packed weights (--decouple-weights)
        self.lock = threading.RLock()
        # Observed by the metrics: prompts in the running batch and KV slots they hold.
        self.running = 0
        self.kv_slots_used = 0

    @property
    def max_seq(self) -> int:
        return self.kv.layout.max_seq

    # ---- start-up ----

    def compile(self, *, fullgraph: bool = True) -> None:
        """torch.compile the step (inductor, static shapes) and compile it for every batch size."""
        _raise_recompile_limit(len(self.batch_sizes))
        self.step = torch.compile(self.decode, backend="inductor", dynamic=False, fullgraph=fullgraph)
        try:
            self._warm_up()
        except Exception as e:
            if not fullgraph:
                raise
            log.warning("fullgraph compile failed (%s: %s); compiling with graph breaks", type(e).__name__, e)
            torch._dynamo.reset()
            self.step = torch.compile(self.decode, backend="inductor", dynamic=False, fullgraph=False)
            self._warm_up()
            fullgraph = False
        self.compiled = True
        self.fullgraph = fullgraph

    def _warm_up(self) -> None:
        for bsz in self.batch_sizes:
            tokens = torch.zeros(bsz, dtype=torch.int64, device=self.device)
            positions = torch.zeros(bsz, dtype=torch.int64, device=self.device)
            with torch.no_grad():
                for _ in range(2):  # the second run hits what the first compiled and autotuned
                    self.step(tokens, positions)
        self._synchronize()

    def capture_graphs(self) -> None:
        """One CUDA graph per batch size (largest first, sharing one memory pool), over static inputs."""
        pool = torch.cuda.graph_pool_handle()
        for bsz in sorted(self.batch_sizes, reverse=True):
            tokens = torch.zeros(bsz, dtype=torch.int64, device=self.device)
            positions = torch.zeros(bsz, dtype=torch.int64, device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.no_grad():
                with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
                    for _ in range(2):
                        self.step(tokens, positions)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.step(tokens, positions)
            self.graphs[bsz] = CapturedStep(graph, tokens, positions, out)
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- generation ----

    def validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """ValueError (a message for the client) unless generate() can run these."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts must be a non-empty list of token id lists")
        for i, p in enumerate(prompts):
            if not isinstance(p, list | tuple) or not p:
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
            for t in p:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(
                        f"prompts[{i}] holds {t!r}: token ids are integers in [0, {self.vocab_size})"
                    )
            if len(p) + max_new_tokens - 1 > self.max_seq:
                raise ValueError(
                    f"prompts[{i}]: {len(p)} prompt + {max_new_tokens} new tokens exceed the "
                    f"{self.max_seq} positions of the KV cache"
                )

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt by `max_new_tokens` tokens, in batches of at most the
        largest batch size, each padded to the smallest batch size that holds it."""
        self.validate(prompts, max_new_tokens)
        out: list[list[int]] = []
        with self.lock, torch.no_grad():
            for start in range(0, len(prompts), self.max_batch):
                out.extend(self._generate_batch(prompts[start : start + self.max_batch], max_new_tokens))
        return out

    def _generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        n = len(prompts)
        bsz = next(b for b in self.batch_sizes if b >= n)
        lens = [len(p) for p in prompts] + [1] * (bsz - n)  # padding rows: one token 0
        longest = max(lens)
        steps = longest + max_new_tokens - 1
        host = torch.zeros((bsz, longest), dtype=torch.int64)
        for i, p in enumerate(prompts):
            host[i, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
        prompt = host.to(self.device)
        lens_dev = torch.tensor(lens, dtype=torch.int64).to(self.device)
        outs = torch.empty((steps, bsz), dtype=torch.int64, device=self.device)
        self.running = n
        self.kv_slots_used = sum(len(p) + max_new_tokens for p in prompts)
        try:
            # All rows advance one position per step; a row feeds its prompt while it lasts, then the
            # token it generated last. Row b's new tokens are the outputs from step len_b - 1 on.
            for t in range(steps):
                if t == 0:
                    tokens = prompt[:, 0]
                else:
                    tokens = torch.where(lens_dev > t, prompt[:, min(t, longest - 1)], outs[t - 1])
                outs[t].copy_(self._run(bsz, tokens, t))
            result = outs.cpu()
        finally:
            self.running = 0
            self.kv_slots_used = 0
        return [result[lens[i] - 1 : lens[i] - 1 + max_new_tokens, i].tolist() for i in range(n)]

    def _run(self, bsz: int, tokens: torch.Tensor, position: int) -> torch.Tensor:
        captured = self.graphs.get(bsz)
        if captured is not None:
            captured.tokens.copy_(tokens)
            captured.positions.fill_(position)
            captured.graph.replay()
            return captured.out
        positions = torch.full((bsz,), position, dtype=torch.int64, device=self.device)
        return self.step(tokens, positions)


def fixed_prompts(vocab_size: int) -> list[list[int]]:
    """The self-test's prompts: four of different lengths, deterministic."""
    return [
        [(1 + 7919 * i + 104729 * j) % vocab_size for j in range(n)] for i, n in enumerate((3, 7, 12, 20))
    ]


# ---- metrics and HTTP --------------------------------------------------------------------------------


class Metrics:
    """Gauges named as vLLM names them, in a registry of their own."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.running = Gauge(
            "vllm:num_requests_running", "Prompts in the batch on the GPU now.", registry=self.registry
        )
        self.running.set_function(lambda: engine.running)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Prompts waiting for the engine.", registry=self.registry
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV cache slots held by running requests (1 = full).",
            registry=self.registry,
        )
        self.kv_usage.set_function(lambda: engine.kv_slots_used / engine.kv.layout.slots)
        self.requests = Counter(
            "vllm:request_success", "Prompts completed.", ["finished_reason"], registry=self.registry
        )
        self.failures = Counter(
            "reference_worker:request_failures", "Requests that failed.", registry=self.registry
        )
        self.latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from arrival to response.", registry=self.registry
        )

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Worker:
    """What the HTTP handlers see: the engine, its metrics, and whether it serves now."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = Metrics(engine)
        self.state = "starting"  # starting | ok | checkpointing | restoring

    @property
    def serving(self) -> bool:
        return self.state == "ok"

    @contextlib.contextmanager
    def engine_turn(self, prompts: int) -> Iterator[bool]:
        """Wait for the engine; yields False (no turn) as soon as it stops serving (a checkpoint), so
        no request waits through a checkpoint with its connection open."""
        self.metrics.waiting.inc(prompts)
        got = False
        try:
            while self.serving and not (got := self.engine.lock.acquire(timeout=0.05)):
                pass
            if got and not self.serving:
                self.engine.lock.release()
                got = False
        finally:
            self.metrics.waiting.dec(prompts)
        try:
            yield got
        finally:
            if got:
                self.engine.lock.release()


class BadRequest(ValueError):
    pass


def parse_generate_body(raw: bytes) -> tuple[list[list[int]], int]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest('body must be a JSON object {"prompts": [[int, ...], ...], "max_new_tokens": n}')
    prompts = body.get("prompts")
    max_new = body.get("max_new_tokens", SELFTEST_NEW_TOKENS)
    if not isinstance(prompts, list):
        raise BadRequest('"prompts" must be a list of token id lists')
    return prompts, max_new


class WorkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], worker: Worker) -> None:
        self.worker = worker
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        # HTTPServer's own asks DNS for the host's name (socket.getfqdn): with no resolver answering, a
        # restored worker would wait for the lookup's timeout before it serves.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class Handler(BaseHTTPRequestHandler):
    server: WorkerHTTPServer
    protocol_version = "HTTP/1.0"  # one request per connection: none stays open into a checkpoint
    server_version = "reference-worker"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def do_GET(self) -> None:
        worker = self.server.worker
        path = self.path.split("?", 1)[0]
        if path == "/health":
            if worker.serving:
                self._json(HTTPStatus.OK, {"status": "ok"})
            else:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"status": worker.state})
        elif path == "/metrics":
            body, content_type = worker.metrics.render()
            self._send(HTTPStatus.OK, body, content_type)
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {path}"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/generate":
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {path}"})
            return
        worker = self.server.worker
        started = time.monotonic()
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._json(HTTPStatus.BAD_REQUEST, {"error": "a Content-Length header is required"})
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._json(HTTPStatus.BAD_REQUEST, {"error": f"the body must be at most {MAX_BODY_BYTES} bytes"})
            return
        try:
            prompts, max_new = parse_generate_body(self.rfile.read(length))
            worker.engine.validate(prompts, max_new)
        except ValueError as e:
            worker.metrics.failures.inc()
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            return
        with worker.engine_turn(len(prompts)) as turn:
            if not turn:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"not serving now ({worker.state})"})
                return
            t0 = time.monotonic()
            try:
                tokens = worker.engine.generate(prompts, max_new)
            except Exception as e:
                log.exception("generate failed")
                worker.metrics.failures.inc()
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"})
                return
            seconds = time.monotonic() - t0
        worker.metrics.requests.labels("length").inc(len(prompts))
        worker.metrics.latency.observe(time.monotonic() - started)
        self._json(HTTPStatus.OK, {"tokens": tokens, "seconds": round(seconds, 6)})


def start_server(worker: Worker, host: str, port: int) -> WorkerHTTPServer:
    server = WorkerHTTPServer((host, port), worker)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


# ---- logging and files -----------------------------------------------------------------------------


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
        }
        out["msg"] = record.getMessage()
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(json_logs: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter() if json_logs else logging.Formatter(f"%(asctime)s {PROG} %(levelname)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def phase(name: str, seconds: float, **fields: Any) -> None:
    extra = "".join(f" {k}={v}" for k, v in fields.items())
    log.info(
        "phase %s: %.3f s%s",
        name,
        seconds,
        extra,
        extra={"fields": {"phase": name, "seconds": seconds, **fields}},
    )


def write_json_atomic(path: Path, obj: Any) -> None:
    # Not fileio.write_atomic: the worker runs without the snapshot SDK too (--timings-file).
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- command line ----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}\n")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise WorkerError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise WorkerError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size", default="1g", help=f"model preset: {', '.join(PRESETS)} (default 1g)")
    p.add_argument("--model-dir", type=Path, help=f"model directory (default {DEFAULT_MODELS_ROOT}/SIZE)")
    p.add_argument("--prepare-only", action="store_true", help="create the model directory and exit")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (prepare)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="compute dtype (default bfloat16)"
    )
    p.add_argument("--decouple-weights", action="store_true", help="pack the weights into one VMM region")
    p.add_argument("--release-kv", action="store_true", help="release the KV cache for the checkpoint")
    p.add_argument("--kv-gib", type=float, default=8.0, help="KV cache size in GiB (default 8)")
    p.add_argument(
        "--kv-backend",
        default="auto",
        choices=("auto", "vmm", "torch"),
        help="KV memory: a KvCache VMM region (vmm), torch tensors, or vmm when cuda-python is there (auto)",
    )
    p.add_argument("--max-seq", type=int, help="cap on positions per sequence (default 32768 cuda, 256 cpu)")
    p.add_argument(
        "--batch-sizes", default="1,4,16", help="batch sizes to compile and capture (default 1,4,16)"
    )
    p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly")
    p.add_argument("--no-fullgraph", action="store_true", help="torch.compile without fullgraph=True")
    p.add_argument("--no-graphs", action="store_true", help="capture no CUDA graphs")
    p.add_argument("--host", default=os.environ.get("WORKER_HOST", "127.0.0.1"), help="listen address")
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("WORKER_PORT", "8000")), help="port (env WORKER_PORT)"
    )
    p.add_argument(
        "--listen-before-checkpoint",
        action="store_true",
        # CRIU 4.1 cannot dump a TCP socket on Linux >= 6.16 (getsockopt SO_PASSCRED is refused for
        # non-unix sockets), and a listener frozen with a client waiting would not dump either.
        help="in a snapshot pod, listen before the checkpoint too (default: only after the handshake)",
    )
    p.add_argument("--weights-file", type=Path, help="the .dsw file (default CONTROL_DIR/weights/model.dsw)")
    p.add_argument(
        "--weights-encoding",
        default="split-nibble",
        choices=("split-nibble", "raw"),
        help="how the decoupled weights file stores them (default split-nibble)",
    )
    p.add_argument(
        "--timings-file",
        type=Path,
        help=f"where to write the cold timings (default CONTROL_DIR/{COLD_TIMINGS_FILE})",
    )
    p.add_argument(
        "--no-release-zero-pages",
        action="store_true",
        help="do not offer the agent to drop the zero pages of the CUDA checkpoint's host copy",
    )
    p.add_argument("--json-logs", action="store_true", help="log JSON lines")
    return p


def resolve_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise WorkerError(f"--device must be cuda, cuda:N or cpu, got {text!r}") from None
    if device.type not in ("cuda", "cpu"):
        raise WorkerError(f"--device must be cuda, cuda:N or cpu, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise WorkerError(
                f"--device {text}: CUDA is not available here (torch {torch.__version__}); use --device cpu"
            )
        device = torch.device("cuda", device.index or 0)
        if device.index >= torch.cuda.device_count():
            raise WorkerError(f"--device {text}: only {torch.cuda.device_count()} CUDA devices")
    return device


def _ensure_model(args: argparse.Namespace, model_dir: Path) -> float:
    """Prepare the model directory in a child process when missing; seconds it took (not timed as
    cold start: the child keeps this process's CUDA context and allocator as a cold start has them)."""
    if model_ready(model_dir):
        return 0.0
    t0 = time.monotonic()
    log.info("preparing %s weights in %s (once, not part of the cold start)", args.size, model_dir)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--prepare-only", "--size", args.size]
    cmd += ["--model-dir", str(model_dir), "--device", args.device, "--seed", str(args.seed)]
    if args.json_logs:
        cmd.append("--json-logs")
    subprocess.run(cmd, check=True)
    seconds = time.monotonic() - t0
    phase("prepare", seconds, dir=str(model_dir))
    return seconds


@dataclasses.dataclass
class ColdStart:
    engine: Engine
    timings: dict[str, Any]


def cold_start(args: argparse.Namespace, device: torch.device, batch_sizes: list[int]) -> ColdStart:
    """Load, pack, allocate, compile, capture: the engine, and what each phase took."""
    dtype = DTYPES[args.dtype]
    model_dir: Path = args.model_dir or default_model_dir(args.size)
    timings: dict[str, Any] = {"import_s": _IMPORTED - _STARTED}
    phase("import", timings["import_s"], torch=torch.__version__, transformers=transformers.__version__)
    timings["prepare_s"] = _ensure_model(args, model_dir)
    config = check_model_dir(model_dir, args.size)

    t = time.monotonic()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    timings["cuda_init_s"] = time.monotonic() - t
    phase("cuda_init", timings["cuda_init_s"], device=str(device))

    t = time.monotonic()
    model = load_model(model_dir, device, dtype)
    timings["load_s"] = time.monotonic() - t
    params = sum(p.numel() for p in model.parameters())
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    timings.update(params=params, weights_bytes=weights_bytes)
    phase("load", timings["load_s"], params=params, gib=round(weights_bytes / 2**30, 3))

    region: WeightRegion | None = None
    t = time.monotonic()
    if args.decouple_weights:
        region = sdk().pack_module(model, device=device.index or 0)
        torch.cuda.empty_cache()  # the loader's copies: give them back to the device
    timings["pack_s"] = time.monotonic() - t
    if region is not None:
        phase("pack", timings["pack_s"], region_bytes=region.region.size if region.region else 0)

    t = time.monotonic()
    kv_bytes = int(args.kv_gib * 2**30)
    cap = args.max_seq or (32768 if device.type == "cuda" else 256)
    layout = plan_kv(config, kv_bytes, batch_sizes[-1], dtype, cap)
    vmm = device.type == "cuda" and args.kv_backend != "torch"
    if vmm and snapshot_sdk is None and args.kv_backend == "auto" and not args.release_kv:
        log.warning("KV cache in torch memory: %s", _SDK_ERROR)
        vmm = False
    elif vmm and args.kv_backend == "auto" and not args.release_kv:
        try:
            sdk().allocation_granularity(device.index or 0)
        except Exception as e:  # no cuda-python: plain torch memory
            log.warning("KV cache in torch memory: the VMM region is not available (%s)", e)
            vmm = False
    kv = KvStore(layout, device, vmm=vmm, kv_bytes=kv_bytes)
    timings["kv_s"] = time.monotonic() - t
    timings.update(kv_bytes=kv.nbytes, max_seq=layout.max_seq, kv_backend="vmm" if vmm else "torch")
    phase("kv", timings["kv_s"], gib=round(kv.nbytes / 2**30, 3), max_seq=layout.max_seq, vmm=vmm)

    engine = Engine(model, kv, batch_sizes, device)
    engine.region = region
    t = time.monotonic()
    if not args.no_compile:
        engine.compile(fullgraph=not args.no_fullgraph)
        stopped = shutdown_compile_workers()
        log.info("inductor compile workers shut down: %s; children now: %s", stopped, child_pids() or "none")
    timings["compile_s"] = time.monotonic() - t
    timings["fullgraph"] = engine.fullgraph
    timings["inductor_cache_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not args.no_compile:
        phase("compile", timings["compile_s"], batch_sizes=batch_sizes, fullgraph=engine.fullgraph)

    t = time.monotonic()
    if not args.no_graphs:
        engine.capture_graphs()
    engine.kv.zero()  # warm-up and capture wrote slots: start from zeros
    timings["graphs_s"] = time.monotonic() - t
    if not args.no_graphs:
        phase("graphs", timings["graphs_s"], batch_sizes=batch_sizes)
    return ColdStart(engine, timings)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.json_logs)
    make_config(args.size)  # WorkerError for an unknown size before anything else
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.kv_gib <= 0:
        raise WorkerError(f"--kv-gib must be > 0, got {args.kv_gib}")
    if args.prepare_only:
        model_dir = args.model_dir or default_model_dir(args.size)
        t = time.monotonic()
        dev = args.device if args.device == "cpu" or torch.cuda.is_available() else "cpu"
        prepare_model(args.size, model_dir, device=dev, seed=args.seed)
        phase(
            "prepare",
            time.monotonic() - t,
            dir=str(model_dir),
            params=parameter_count(make_config(args.size)),
        )
        return 0
    device = resolve_device(args.device)
    if device.type != "cuda":
        if args.decouple_weights or args.release_kv:
            raise WorkerError("--decouple-weights and --release-kv need CUDA (VMM regions)")
        if not args.no_graphs:
            log.info("no CUDA graphs on %s", device)
            args.no_graphs = True
    if args.release_kv and args.kv_backend == "torch":
        raise WorkerError("--release-kv needs the KV cache in a VMM region (--kv-backend vmm or auto)")

    handshake: SnapshotHandshake | None = None
    if snapshot_sdk is not None:
        handshake = snapshot_sdk.SnapshotHandshake.maybe_from_env()
        if handshake is not None:
            handshake.release_zero_pages = not args.no_release_zero_pages
    elif any(os.environ.get(name) for name in _CONTROL_DIR_ENVS):
        sdk()  # a snapshot pod, and no SDK to do the handshake with: say why
    start = cold_start(args, device, batch_sizes)
    engine, timings = start.engine, start.timings
    worker = Worker(engine)
    server = None
    if handshake is None or args.listen_before_checkpoint:
        server = start_server(worker, args.host, args.port)
        log.info("listening on http://%s:%d", args.host, server.server_address[1])

    prompts = fixed_prompts(engine.vocab_size)
    t = time.monotonic()
    selftest = engine.generate(prompts, SELFTEST_NEW_TOKENS)
    timings["selftest_s"] = time.monotonic() - t
    phase("selftest", timings["selftest_s"])
    ready_at = time.time()
    timings.update(
        # The start -> ready time less the one-off preparation of a missing model directory.
        total_s=time.monotonic() - _STARTED - timings["prepare_s"],
        started_at=_STARTED_AT,
        ready_at=ready_at,
        batch_sizes=batch_sizes,
        selftest_prompts=prompts,
        selftest_tokens=selftest,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        size=args.size,
        device=str(device),
        dtype=args.dtype,
        compiled=engine.compiled,
        graphs=sorted(engine.graphs),
        decouple_weights=args.decouple_weights,
        release_kv=args.release_kv,
        child_pids=child_pids(),
    )
    phase("ready", timings["total_s"], params=timings["params"])
    timings_path = args.timings_file or (handshake.control_dir / COLD_TIMINGS_FILE if handshake else None)
    if timings_path is not None:
        write_json_atomic(timings_path, timings)
    worker.state = "ok"

    if handshake is not None:
        code = checkpoint(args, handshake, worker, selftest)
        if code:
            return code
        if server is None:
            server = start_server(worker, args.host, args.port)
            log.info("listening on http://%s:%d", args.host, server.server_address[1])
    return serve_until_signalled(server)


def shrink_host_memory() -> None:
    """Give freed host memory back to the kernel before CRIU dumps it: the loader's and the compiler's
    garbage, torch's cache of pinned buffers and malloc's free lists would otherwise all be copied into
    the image and read back at every restore."""
    gc.collect()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        with contextlib.suppress(RuntimeError):
            empty_host_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def checkpoint(
    args: argparse.Namespace,
    handshake: SnapshotHandshake,
    worker: Worker,
    selftest: list[list[int]],
) -> int:
    """The snapshot handshake with the engine held: register what is released, signal, wait, check."""
    engine = worker.engine
    region = engine.region
    registered = False
    if args.release_kv and engine.kv.cache is not None:
        handshake.register_kv_cache(engine.kv.cache)
        registered = True
    if region is not None:
        weights_file = args.weights_file or handshake.control_dir / "weights" / "model.dsw"
        handshake.register_weights(region, weights_file)
        registered = True
    if registered:
        handshake.gpu_offload.zero_kv = True  # stale KV memory must never be NaN under the mask
        handshake.gpu_offload.weights_encoding = args.weights_encoding
    with engine.lock:
        worker.state = "checkpointing"
        if engine.device.type == "cuda":
            engine._synchronize()
            torch.cuda.empty_cache()  # cached but unused blocks would be checkpointed too
        shrink_host_memory()
        children = child_pids()
        if children:
            log.warning("child processes at checkpoint time (CRIU dumps them too): %s", children)
        # What the checkpoint will hold, for anyone sizing artifacts (the benchmark reports it).
        with contextlib.suppress(OSError, RuntimeError):
            write_json_atomic(
                handshake.control_dir / CHECKPOINT_MEMORY_FILE,
                {"host": host_memory_report(), "gpu": gpu_memory_report(engine.device), "children": children},
            )
        log.info("signalling ready for checkpoint in %s", handshake.control_dir)
        try:
            info = handshake.checkpoint_and_wait()
        except Exception:
            log.exception("the checkpoint handshake failed")
            return 1
        resumed_at = time.time()
        worker.state = "restoring"
        log.info("resumed (restored=%s, pod %s) after %.1f s", info.restored, info.pod_name, info.waited_s)
        t = time.monotonic()
        engine.kv.zero()
        again = engine.generate(fixed_prompts(engine.vocab_size), SELFTEST_NEW_TOKENS)
        selftest_s = time.monotonic() - t
        identical = again == selftest
        if not identical:
            log.error("the self-test after the resume differs from the cold one")
        write_json_atomic(
            handshake.control_dir / RESUME_FILE,
            {
                "resumed_at": resumed_at,
                # The agent's clock when it wrote restore-complete: how long the worker took to wake.
                "restore_complete_at": (info.content or {}).get("restoredAt")
                if isinstance(info.content, dict)
                else None,
                "restored": info.restored,
                "pod_name": info.pod_name,
                "waited_s": info.waited_s,
                "offload": handshake.gpu_offload.report.to_dict() if registered else None,
                "selftest_tokens": again,
                "selftest_identical": identical,
                "selftest_s": selftest_s,
                "ready_at": time.time(),
            },
        )
        phase("resume", selftest_s, restored=info.restored, selftest_identical=identical)
        worker.state = "ok"
    return 0


def serve_until_signalled(server: WorkerHTTPServer | None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(1.0):
        pass
    if server is not None:
        server.shutdown()
        server.server_close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except WorkerError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
