"""The reference worker (examples/reference_worker/worker.py) on the CPU: its hand-written decode step
is the real Qwen3 architecture (same greedy tokens as transformers' own forward), its presets weigh
what their names say, and its HTTP server answers as documented. Skipped where torch or transformers
is not installed; what needs a GPU (compile, CUDA graphs, VMM regions, the handshake) is not here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "examples" / "reference_worker" / "worker.py"


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference_worker", WORKER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


rw = _load_worker()

PROMPTS = [[5, 17, 300, 42], [7], [1000, 3, 3, 3, 9, 2047, 64], [12, 13]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rw.prepare_model("tiny", tmp_path_factory.mktemp("models") / "tiny", device="cpu", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Any:
    config = rw.check_model_dir(model_dir, "tiny")
    device = torch.device("cpu")
    model = rw.load_model(model_dir, device, torch.float32)
    layout = rw.plan_kv(config, 64 << 20, 4, torch.float32, cap=128)
    kv = rw.KvStore(layout, device, vmm=False, kv_bytes=64 << 20)
    return rw.Engine(model, kv, [1, 2, 4], device)


def _hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own Qwen3ForCausalLM: full sequence, no cache, argmax of the last position."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config.from_pretrained(str(model_dir))
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    state = {k: v.to(torch.float32) for k, v in load_file(str(model_dir / rw.WEIGHTS_FILE_NAME)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert all("rotary" in k for k in missing), missing
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


def test_decode_step_matches_transformers(model_dir: Path, engine: Any) -> None:
    ours = engine.generate(PROMPTS, NEW_TOKENS)
    assert ours == _hf_greedy(model_dir, PROMPTS, NEW_TOKENS)
    # Deterministic, and independent of the batch it runs in (padding rows, other prompts).
    assert engine.generate(PROMPTS, NEW_TOKENS) == ours
    assert [engine.generate([p], NEW_TOKENS)[0] for p in PROMPTS] == ours


def test_generate_chunks_batches_larger_than_the_largest(engine: Any) -> None:
    many = PROMPTS * 2  # 8 prompts, largest batch 4
    assert engine.generate(many, 3) == engine.generate(PROMPTS, 3) * 2


def test_generate_rejects_bad_input(engine: Any) -> None:
    for prompts, new in (
        ([], 4),
        ([[]], 4),
        ([[1, 2048]], 4),
        ([[1, -1]], 4),
        ([["a"]], 4),
        ([[1]], 0),
        ([[1]], True),
        ([[1] * 100], 100),  # past the 128 positions of the cache
    ):
        with pytest.raises(ValueError):  # noqa: PT011  (the messages differ)
            engine.generate(prompts, new)


@pytest.mark.parametrize("size", sorted(rw.PRESETS))
def test_preset_sizes(size: str) -> None:
    config = rw.make_config(size)
    nbytes = 0
    for p in rw.meta_model(config).parameters():
        assert p.device.type == "meta"
        nbytes += p.numel() * 2  # bf16
    nominal = rw.NOMINAL_BYTES[size]
    assert 0.85 * nominal <= nbytes <= 1.15 * nominal, (size, nbytes / 2**30)
    if size != "tiny":
        # Real models' depth: what torch.compile traces, and so the cold start, is an engine's.
        assert config.num_hidden_layers >= 28
        assert config.num_attention_heads % config.num_key_value_heads == 0


def test_kv_plan() -> None:
    config = rw.make_config("1g")
    layout = rw.plan_kv(config, 8 << 30, 16, torch.bfloat16, cap=32768)
    total = 2 * config.num_hidden_layers * (layout.tensor_bytes + 256)
    assert total <= 8 << 30
    assert layout.max_seq % 16 == 0
    # 16 more positions would not fit: the cache is used, not wasted.
    per_position = 16 * config.num_key_value_heads * rw.head_dim_of(config) * 2
    assert total + 2 * config.num_hidden_layers * 16 * per_position > 8 << 30
    assert rw.plan_kv(config, 8 << 30, 16, torch.bfloat16, cap=4096).max_seq == 4096
    with pytest.raises(rw.WorkerError, match="--kv-gib"):
        rw.plan_kv(config, 16 << 20, 16, torch.bfloat16, cap=32768)


def test_bad_size_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert rw.main(["--size", "3g", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--size" in err[0]
    assert "tiny" in err[0]


# ---- the HTTP server, in a subprocess ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, body: bytes | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    env = {k: v for k, v in os.environ.items() if k not in rw._CONTROL_DIR_ENVS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(WORKER), "--size", "tiny", "--device", "cpu", "--no-compile", "--dtype"]
    cmd += ["float32", "--model-dir", str(model_dir), "--port", str(port), "--batch-sizes", "1,2,4"]
    cmd += ["--kv-gib", "0.0625", "--max-seq", "128"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the worker exited {proc.returncode}:\n{log_path.read_text()}")
            try:
                if _request(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the worker did not become healthy:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=30) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()


def test_http_generate_matches_in_process(server: str, engine: Any) -> None:
    body = json.dumps({"prompts": PROMPTS, "max_new_tokens": NEW_TOKENS}).encode()
    status, raw, headers = _request(f"{server}/generate", body)
    assert status == 200, raw
    assert headers.get("Connection") == "close"
    reply = json.loads(raw)
    assert reply["tokens"] == engine.generate(PROMPTS, NEW_TOKENS)
    assert reply["seconds"] >= 0


def test_http_health_and_metrics(server: str) -> None:
    status, raw, _ = _request(f"{server}/health")
    assert (status, json.loads(raw)) == (200, {"status": "ok"})
    status, raw, _ = _request(f"{server}/metrics")
    assert status == 200
    text = raw.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"\n{name} " in text, name
    assert "vllm:request_success_total" in text


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompts": 3}', "prompts"),
        (b'{"prompts": [[1, 99999]], "max_new_tokens": 2}', "token ids"),
        (b'{"prompts": [[1]], "max_new_tokens": "x"}', "max_new_tokens"),
        (b'{"prompts": [[1]], "max_new_tokens": 1000}', "positions"),
    ],
)
def test_http_bad_body_is_400(server: str, body: bytes, needle: str) -> None:
    status, raw, _ = _request(f"{server}/generate", body)
    assert status == 400
    reply = json.loads(raw)
    assert needle in reply["error"]
    assert "Traceback" not in reply["error"]


def test_http_unknown_path_is_404(server: str) -> None:
    assert _request(f"{server}/nope")[0] == 404


def test_host_memory_report_counts_this_process() -> None:
    before = rw.host_memory_report()
    grown = b"\x01" * (64 << 20)  # 64 MiB of anonymous memory, every page written
    report = rw.host_memory_report(top=3)
    assert report["anonymous_kib"] - before["anonymous_kib"] >= 60 << 10
    assert report["private_dirty_kib"] >= report["anonymous_kib"] // 2
    assert report["rss_kib"] >= report["anonymous_kib"]
    assert len(report["private_dirty_by_mapping_kib"]) <= 3
    assert report["mappings"] > 10
    del grown
    assert rw.gpu_memory_report(torch.device("cpu")) == {}
