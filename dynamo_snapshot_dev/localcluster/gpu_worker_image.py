"""The GPU reference worker's image, built on the GPU machine from its own Python environment (no registry
there) and imported into the node's containerd: `build_and_import_gpu_worker_image`, or

    python3 -m dynamo_snapshot_dev.localcluster.gpu_worker_image --ctr BIN --containerd-socket SOCK \
        [--site /tmp/site] [--plan]

It is `venv_image`'s worker image with the machine's /usr taken whole besides the venv
(/opt/torch/.venv): torch.compile's inductor and Triton compile C at run time (gcc 13, binutils, the C
library's and Python's headers), torch and Triton find libraries through the loader's cache and
`ldconfig -p`, and a closure of what one cold start opens could not show that no other run needs more.
/usr less its documentation and kernel sources; the NVIDIA driver's files (/usr/local/nvidia, a mount of
its own) stay out: the node injects them into the containers that ask for a GPU (CDI). Pods run the
worker as `restore_bench.py` runs it (`gpu_worker_command`, `gpu_worker_env`), with an empty compile
cache: the image has none of the host's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from dynamo_snapshot_dev.localcluster.host_trees import HostFile, Tree
from dynamo_snapshot_dev.localcluster.images import ImageBuildError, ImageRef
from dynamo_snapshot_dev.localcluster.realnode.host import CONTAINERD_NAMESPACE
from dynamo_snapshot_dev.localcluster.venv_image import APP_DIR, WorkerImageSpec, build_and_import, select

GPU_PYTHON = Path("/opt/torch/.venv/bin/python3")
GPU_WORKER_REPOSITORY = "localhost/dynamo-snapshot/gpu-worker"
GPU_WORKER_SCRIPT = "examples/reference_worker/worker.py"
# Read by people, never by a program the worker runs: manuals and package documentation; kernel and
# package sources (the compiler searches /usr/include and its own directories, never /usr/src).
USR_SKIP = frozenset({"share/doc", "share/man", "share/info", "src"})


def gpu_worker_spec(
    python: Path = GPU_PYTHON, site_dirs: Sequence[Path] = (), skip: Sequence[str] = ()
) -> WorkerImageSpec:
    """The GPU worker's image: `python`'s venv and /usr, `site_dirs` (the project's dependencies
    installed with `pip install --target`) on PYTHONPATH; `skip`: more absolute paths to leave out."""
    return WorkerImageSpec(
        repository=GPU_WORKER_REPOSITORY,
        python=python,
        script=GPU_WORKER_SCRIPT,
        trees=(Tree(Path("/usr"), USR_SKIP),),
        # /usr is whole: every system library the venv's ELF files load is in it (the driver's come by CDI).
        resolve_libraries=False,
        site_dirs=tuple(site_dirs),
        skip=frozenset(skip),
    )


def build_and_import_gpu_worker_image(
    ctr: Path,
    containerd_socket: Path,
    *,
    python: Path = GPU_PYTHON,
    site_dirs: Sequence[Path] = (),
    skip: Sequence[str] = (),
    namespace: str = CONTAINERD_NAMESPACE,
    repo: Path | None = None,
    say: Callable[[str], None] = print,
) -> ImageRef:
    """Build the GPU worker's image from this machine's environment and import it into the containerd at
    `containerd_socket` (nothing is built when an image of the same tag is there); prints each phase's
    seconds and the bytes and files it holds."""
    spec = gpu_worker_spec(python, site_dirs, skip)
    return build_and_import(spec, ctr, containerd_socket, namespace=namespace, repo=repo, say=say).image


def gpu_worker_command(
    size: str,
    *,
    model_dir: str,
    kv_gib: float,
    port: int,
    flags: Sequence[str] = (),
    python: Path = GPU_PYTHON,
) -> list[str]:
    """The worker's command line in a pod of the image, as `restore_bench.py` starts it as a process."""
    script = f"{APP_DIR}/{GPU_WORKER_SCRIPT}"
    argv = [str(python), script, "--size", size, "--model-dir", model_dir, "--kv-gib", str(kv_gib)]
    return [*argv, "--port", str(port), *flags]


def gpu_worker_env(compile_cache: str, port: int) -> dict[str, str]:
    """The environment `restore_bench.py` gives the worker, for a pod (which listens on its pod IP;
    PYTHONPATH is the image's). `compile_cache` is where torch.compile and Triton write, empty at first."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": compile_cache,
        "TRITON_CACHE_DIR": f"{compile_cache}/triton",
        "WORKER_PORT": str(port),
        "WORKER_HOST": "0.0.0.0",
    }


def plan_lines(files: Sequence[HostFile], top: int = 25) -> list[str]:
    """The largest parts of a selection: directories three levels down, and each installed package."""
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for f in files:
        parts = f.path.split("/")
        keys = {"/".join(parts[:3])}
        if "site-packages" in parts[:-1]:
            keys.add("/".join(parts[: parts.index("site-packages") + 2]))
        for key in keys:
            sizes[key][0] += f.size
            sizes[key][1] += 1
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"{b / 1e9:8.3f} GB {n:8d} files  /{key}" for key, (b, n) in ranked]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctr", type=Path, help="the ctr binary (the node bundle's)")
    p.add_argument("--containerd-socket", type=Path, help="the node's containerd socket")
    p.add_argument("--namespace", default=CONTAINERD_NAMESPACE)
    p.add_argument("--python", type=Path, default=GPU_PYTHON, help="the venv's interpreter pods run")
    p.add_argument("--site", type=Path, action="append", default=[], help="installed packages to add")
    p.add_argument("--skip", action="append", default=[], help="an absolute path to leave out")
    p.add_argument("--plan", action="store_true", help="print what the image would hold; import nothing")
    args = p.parse_args(argv)
    try:
        if args.plan:
            with tempfile.TemporaryDirectory(prefix="worker-image-") as tmp:
                sel = select(gpu_worker_spec(args.python, args.site, args.skip), Path(tmp))
            print(f"{sel.image.name}: {len(sel.files)} files, {sel.size / 1e9:.2f} GB")
            print("\n".join([*sel.report.lines(), *plan_lines(sel.files)]))
            return 0
        if args.ctr is None or args.containerd_socket is None:
            p.error("--ctr and --containerd-socket are needed to import (or give --plan)")
        ref = build_and_import_gpu_worker_image(
            args.ctr, args.containerd_socket, python=args.python, site_dirs=args.site, skip=args.skip,
            namespace=args.namespace,
        )  # fmt: skip
    except ImageBuildError as e:
        print(f"gpu worker image: {e}", file=sys.stderr)
        return 2
    print(ref.name)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
