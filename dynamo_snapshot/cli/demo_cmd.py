"""`dynamo-snapshot demo`: the local, one-machine experience.

Today it brings up the real local control plane with the CRDs and fake GPU nodes and tells you how to use
it; the full Auto-mode story (cold start, checkpoint, scale-up and failover by restore) is built on top of
this by the controller and agent.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.localcluster import LocalCluster, LocalClusterError
from dynamo_snapshot.localcluster.cluster import ClusterOptions
from dynamo_snapshot.localcluster.components import ComponentsMissingError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("demo", help="run the local demo on this machine")
    p.add_argument("--workdir", type=Path, help="where cluster state and logs go (default: a temp dir)")
    p.add_argument("--apiserver-port", type=int, help="fixed kube-apiserver port (default: a free one)")
    p.add_argument("--gpu-nodes", type=int, default=2, help="fake GPU nodes to create (default 2)")
    p.add_argument("--no-wait", action="store_true", help="tear down right after set-up (for scripts)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dynamo-snapshot-demo-"))
    cluster = LocalCluster(workdir, options=ClusterOptions(apiserver_port=args.apiserver_port))
    try:
        with console.status("starting the local control plane") as status:
            cluster.start(progress=lambda m: status.update(m))
            crd_names = []
            for name, text in sorted(crdgen.render_crds().items()):
                applied = cluster.kubectl("apply", "--server-side", "-f", "-", "-o", "name", input=text)
                crd_names += applied.stdout.split()
                console.log(f"installed {name}")
            cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crd_names)
            for i in range(args.gpu_nodes):
                cluster.add_gpu_node(f"gpu-node-{i}")
        console.print(f"[green]ready[/] control plane at {cluster.server}, {args.gpu_nodes} fake H200 nodes")
        console.print(f"  export KUBECONFIG={cluster.kubeconfig}")
        console.print(f"  export PATH={cluster.components.bin_dir}:$PATH")
        console.print("  kubectl get nodes -L nvidia.com/gpu.product; kubectl get dgd,dckpt -A")
        console.print(f"  logs: {workdir / 'logs'}")
        if not args.no_wait:
            console.print("Press Ctrl-C to stop and clean up.")
            _wait_for_signal()
    except (LocalClusterError, ComponentsMissingError) as e:
        console.print(f"[red]demo failed:[/] {e}")
        return 1
    finally:
        cluster.stop()
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
