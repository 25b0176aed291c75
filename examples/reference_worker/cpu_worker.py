"""CPU reference worker: the smallest honest stand-in for an inference worker, for machines without a GPU
(the local demo, CI). Standard library plus the snapshot SDK only.

Start-up does real work, the kind a real worker's cold start is made of, only smaller:
- "load weights": fill WORKER_WEIGHTS_MIB (default 256) MiB of memory from a seeded generator;
- "compile": a CPU-bound warm-up loop of WORKER_COMPILE_ROUNDS (default 3,000,000) SHA-256 rounds whose
  result the requests use (a stand-in for kernel autotuning and graph capture).

Then, in a snapshot pod (SNAPSHOT_CONTROL_DIR set), it goes through the checkpoint handshake and only
after it (restored or not) opens its HTTP listener: a listening socket must not be in the checkpoint.
In a restore pod on a kubelet node (SNAPSHOT_RESTORE_STANDBY=1) it does none of that: it waits as the
container's placeholder until the node agent restores the checkpointed worker into the container.

Restored into one of several containers of a pod (Dynamo's engine failover: restore-container-map
`main=engine-0,main=engine-1`), it takes part in the engines' election when its restore container says
FAILOVER_LOCK_PATH (restore-context.json, as Dynamo carries it with ENGINE_ID): it serves only once it holds
an exclusive flock on that file, which the kernel releases when the holder dies, so a shadow takes over.

HTTP on WORKER_HOST (default 127.0.0.1; a kubelet pod sets 0.0.0.0):<free port> (WORKER_PORT to fix it):
POST /generate sleeps WORKER_SERVICE_MS (default 100) per request with at most WORKER_CONCURRENCY
(default 2) running at once — the rest wait, which is what `vllm:num_requests_waiting` reports on
/metrics (vLLM's names, so the same scaling policies apply); GET /health answers 200 once serving. The
bound address is written to `<pod>.json` in WORKER_ENDPOINT_DIR when set (the demo's service
discovery), else to `endpoint.json` in the control dir.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer

from dynamo_snapshot.workload import SnapshotHandshake, run_standby, standby_requested

ENDPOINT_FILE = "endpoint.json"


def load_weights(mib: int) -> bytearray:
    rng = random.Random(20261129)
    weights = bytearray(mib << 20)
    for start in range(0, len(weights), 1 << 20):  # randbytes takes at most ~256 MiB at once
        weights[start : start + (1 << 20)] = rng.randbytes(1 << 20)
    return weights


def compile_kernels(rounds: int, weights: bytearray) -> bytes:
    digest = hashlib.sha256(weights[:4096]).digest()
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest


class Engine:
    def __init__(self, weights: bytearray, kernel: bytes, concurrency: int, service_s: float) -> None:
        self.weights = weights
        self.kernel = kernel
        self.service_s = service_s
        self.slots = threading.BoundedSemaphore(concurrency)
        self.lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.served = 0

    def generate(self, prompt: bytes) -> str:
        with self.lock:
            self.waiting += 1
        with self.slots:
            with self.lock:
                self.waiting -= 1
                self.running += 1
            try:
                time.sleep(self.service_s)
                offset = int.from_bytes(hashlib.sha256(prompt).digest()[:4], "big") % (len(self.weights) - 32)
                return hashlib.sha256(self.kernel + bytes(self.weights[offset : offset + 32])).hexdigest()
            finally:
                with self.lock:
                    self.running -= 1
                    self.served += 1

    def metrics(self, pod: str) -> bytes:
        with self.lock:
            waiting, running, served = self.waiting, self.running, self.served
        label = f'{{pod="{pod}",model_name="cpu-reference"}}'
        lines = [
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {waiting}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {running}",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{label} {served}",
        ]
        return ("\n".join(lines) + "\n").encode()


class _Server(ThreadingHTTPServer):
    def server_bind(self) -> None:
        # HTTPServer's own asks DNS for the host's name (socket.getfqdn): with no resolver answering, a
        # restored worker would wait for the lookup's timeout (10 s) before it serves.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


def serve(engine: Engine, pod: str, endpoint_file: Path | None) -> None:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, json.dumps({"pod": pod, "pid": os.getpid()}).encode())
            elif self.path == "/metrics":
                self._answer(200, engine.metrics(pod), "text/plain; version=0.0.4")
            else:
                self._answer(404, b"{}")

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._answer(404, b"{}")
                return
            prompt = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(200, json.dumps({"text": engine.generate(prompt), "pod": pod}).encode())

        def log_message(self, format: str, *args: object) -> None:
            pass

    host = os.environ.get("WORKER_HOST", "127.0.0.1")
    server = _Server((host, int(os.environ.get("WORKER_PORT", "0"))), Handler)
    server.daemon_threads = True
    if endpoint_file is not None:
        tmp = endpoint_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": host, "port": server.server_address[1], "pod": pod}))
        os.replace(tmp, endpoint_file)
    print(f"serving on {host}:{server.server_address[1]} as {pod}", flush=True)
    server.serve_forever()


def win_election(lock_path: str, engine_id: str) -> int:
    """Block until this engine holds the failover lock (an exclusive flock on ``lock_path``); the open
    descriptor is returned and kept: the kernel lets go of the lock when this process dies."""
    t0 = time.monotonic()
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print(f"engine {engine_id} holds the failover lock after {time.monotonic() - t0:.2f}s", flush=True)
    return fd


def main() -> int:
    if standby_requested():
        return run_standby()  # a restore pod: the node agent brings the checkpointed worker back here
    t0 = time.monotonic()
    weights = load_weights(int(os.environ.get("WORKER_WEIGHTS_MIB", "256")))
    kernel = compile_kernels(int(os.environ.get("WORKER_COMPILE_ROUNDS", "3000000")), weights)
    engine = Engine(
        weights,
        kernel,
        concurrency=int(os.environ.get("WORKER_CONCURRENCY", "2")),
        service_s=float(os.environ.get("WORKER_SERVICE_MS", "100")) / 1000,
    )
    print(f"initialized in {time.monotonic() - t0:.2f}s", flush=True)
    pod = os.environ.get("POD_NAME", "cpu-worker")
    handshake = SnapshotHandshake.maybe_from_env()
    endpoint: Path | None = None
    if handshake is not None:
        info = handshake.checkpoint_and_wait()
        if not info.restored:
            return 0  # dumped and left running: the restored copies carry on
        pod = info.pod_name or pod  # the environment is still the checkpoint pod's
        endpoint = handshake.control_dir / ENDPOINT_FILE
        lock_path = info.context_env.get("FAILOVER_LOCK_PATH")
        if lock_path:
            win_election(lock_path, info.context_env.get("ENGINE_ID", "0"))
    if os.environ.get("WORKER_ENDPOINT_DIR"):
        endpoint = Path(os.environ["WORKER_ENDPOINT_DIR"]) / f"{pod}.json"
    serve(engine, pod, endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
