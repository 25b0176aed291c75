"""The two workers vs_nvidia_snapshot.py has both agents capture and restore, from one image
(nvidia_peer.workload_image): the CPU reference worker, and a Dynamo 1.6 worker with Dynamo's mocker engine
(examples/reference_worker/dynamo_mocker_worker.py, as tests/integration/test_dynamo_contract.py runs it).

The Dynamo worker's pod is the contract test's: Dynamo's packages (scripts/dynamo-wheels.sh), a tiny model
and the file-discovery directory from the host at the same paths, the io_uring-blocking seccomp profile the
real node installs. It serves once Dynamo's system server answers ``GET /health`` 200 on its port, which with
``DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS=["generate"]`` and a `notready` start is once its generate endpoint is
registered: a restored copy creates its runtime after the restore, so that time includes Dynamo's start of
the runtime, not only the restore. Its source exits 0 when told snapshot-complete (both agents write it).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.nvidia_peer import Workload
from dynamo_snapshot_dev.localcluster.components import cache_dir
from dynamo_snapshot_dev.localcluster.images import ImageRef
from dynamo_snapshot_dev.localcluster.realnode import NO_IO_URING_PROFILE
from tests.helpers.dynamo import MOCKER_WORKER, dynamo_version, pod_worker_env, write_tiny_model
from tests.helpers.kubelet_stack import PORT

# As benchmarks/kubelet_restore.py's worker (tests/helpers/kubelet_stack.py graph_manifest), less its limit.
CPU_WORKER_ENV = {
    "WORKER_WEIGHTS_MIB": "24",
    "WORKER_COMPILE_ROUNDS": "20000",
    "WORKER_SERVICE_MS": "1",
    "WORKER_HOST": "0.0.0.0",
    "WORKER_PORT": str(PORT),
}
MOCKER_MODEL = "tiny-mocker"
SYSTEM_PORT = 9090


def cpu_worker(image: ImageRef, archive: Path) -> Workload:
    return Workload("cpu-worker", image, archive, dict(CPU_WORKER_ENV))


def dynamo_site() -> Path | None:
    """The site-packages of the pinned Dynamo wheels, or None where scripts/dynamo-wheels.sh has not run."""
    venv = cache_dir() / f"dynamo-{dynamo_version()}"
    return venv / "lib/python3.11/site-packages" if (venv / ".complete").is_file() else None


def dynamo_mocker(image: ImageRef, archive: Path, workdir: Path, site: Path) -> Workload:
    """The Dynamo mocker worker; its model and discovery directory under ``workdir``."""
    model = write_tiny_model(workdir / "model", MOCKER_MODEL)
    kv = workdir / "kv"
    kv.mkdir(parents=True, exist_ok=True)
    mounts = {"dynamo-site": site, "model": model, "kv": kv, "examples": MOCKER_WORKER.parent}
    env = {
        **pod_worker_env(site, kv, SYSTEM_PORT),
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        "DYN_SYSTEM_STARTING_HEALTH_STATUS": "notready",
    }
    main = {
        "command": ["/usr/bin/python3.11", str(MOCKER_WORKER)],
        "args": ["--model-path", str(model), "--model-name", MOCKER_MODEL],
        "volumeMounts": [
            {"name": name, "mountPath": str(path), "readOnly": name != "kv"} for name, path in mounts.items()
        ],
    }
    return Workload(
        "dynamo-mocker",
        image,
        archive,
        env,
        port=SYSTEM_PORT,
        main=main,
        volumes=[{"name": name, "hostPath": {"path": str(path)}} for name, path in mounts.items()],
        spec={
            "securityContext": {
                "seccompProfile": {"type": "Localhost", "localhostProfile": NO_IO_URING_PROFILE}
            }
        },
        prompt=None,
    )
