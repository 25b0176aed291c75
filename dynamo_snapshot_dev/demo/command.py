"""`dynamo-snapshot-demo`: the whole story on one machine, with real parts and real measurements.

It starts the local control plane (etcd, kube-apiserver, scheduler, controller-manager) with a real
kubelet + containerd node, Prometheus, the controller and the node agent (workers in kubelet pods of the
locally built worker image, checkpointed in place and restored into their restore pods' own containers
with CRIU; `--chart`: the Helm chart installed on that node, its controller and agent pods doing that
work; `--kwok`: fake H200 nodes whose agents launch the workers as runc containers), applies a
DynamoGraphDeployment in Auto mode running the CPU reference worker, then:
cold start and checkpoint, load-driven scale-up by restore, a killed worker replaced by restore, and the
scale-down. It ends with a table of measured times, `summary.json` and a PNG of load and replicas, and
cleans up after itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from dynamo_snapshot.cli.logs import setup_logging

if TYPE_CHECKING:
    from dynamo_snapshot_dev.demo.stack import Stack

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynamo-snapshot-demo",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="exit codes: 0 done, 1 failed (one line says why), 2 bad usage, 130 interrupted",
    )
    p.add_argument("--out", type=Path, default=Path("demo-results"), help="where summary.json and the PNG go")
    p.add_argument("--workdir", type=Path, help="cluster state, artifacts and logs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (logs, artifacts) afterwards")
    p.add_argument("--apiserver-port", type=int, help="fixed kube-apiserver port (default: a free one)")
    p.add_argument(
        "--kwok",
        action="store_true",
        help="fake GPU nodes (kwok) whose agents launch the workers, instead of the real kubelet node",
    )
    p.add_argument(
        "--chart",
        action="store_true",
        help="install the Helm chart (controller and agent images built from this checkout) on the "
        "kubelet node and let its pods run the story, instead of an in-process controller and agent",
    )
    p.add_argument(
        "--gpu-nodes",
        type=int,
        default=3,
        help="with --kwok: fake GPU nodes, one node agent each (default 3)",
    )
    p.add_argument(
        "--storage",
        choices=("volume", "s3"),
        default="volume",
        help="volume: one artifact store shared by the nodes (default); s3: each node keeps its own and "
        "every checkpoint goes through a local S3-compatible server (SeaweedFS), fetched by the nodes "
        "that restore it",
    )
    p.add_argument("--quick", action="store_true", help="a smaller worker and a shorter story (tests, CI)")
    p.add_argument(
        "--setup-only",
        action="store_true",
        help="only bring up the control plane, CRDs and nodes, check they work, and clean up again; "
        "with --hold, keep them up and print how to reach them",
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the story (or the setup, with --setup-only) keep everything up, print the "
        "KUBECONFIG and PATH to reach it, and clean up on Ctrl-C or SIGTERM",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    own_workdir = args.workdir is None
    # Not under /tmp: the workers' registration directory is bind-mounted into their containers, whose
    # /tmp is a tmpfs of their own.
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dynamo-snapshot-demo-", dir="/var/tmp"))
    if not args.setup_only and Path("/dev/nvidiactl").exists():
        console.print(
            "[yellow]note:[/] this machine has an NVIDIA GPU, but the demo runs the CPU reference worker "
            "(the GPU one is not wired into the demo yet); GPU restore numbers: BENCHMARKS.md"
        )
    try:
        return asyncio.run(_main(args, console, workdir))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return EXIT_INTERRUPTED
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif args.keep:
            console.print(f"workdir kept: {workdir}")


def _failures() -> tuple[type[Exception], ...]:
    """What ends the demo with one line instead of a traceback: the errors that name their fix."""
    from dynamo_snapshot.criu import CriuError
    from dynamo_snapshot_dev.demo.stack import DemoError
    from dynamo_snapshot_dev.localcluster import LocalClusterError
    from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError
    from dynamo_snapshot_dev.localcluster.prometheus import LocalPrometheusError

    return (DemoError, LocalClusterError, ComponentsMissingError, LocalPrometheusError, CriuError)


async def _main(args: argparse.Namespace, console: Console, workdir: Path) -> int:
    # Imported here, not at the top: `--help` and a usage error answer without loading the local cluster.
    from dynamo_snapshot_dev.demo.report import plot, table
    from dynamo_snapshot_dev.demo.scenario import Profile, Scenario
    from dynamo_snapshot_dev.demo.stack import Stack

    failures = _failures()
    args.out.mkdir(parents=True, exist_ok=True)
    setup_logging("info", path=args.out / "components.jsonl")  # controller and agents
    stack = Stack(
        workdir,
        nodes=args.gpu_nodes,
        kubelet=not args.kwok,
        chart=args.chart,
        logs_dir=args.out if args.chart else None,
        storage=args.storage,
        apiserver_port=args.apiserver_port,
        say=console.log,
    )
    try:
        if args.setup_only:
            await stack.start_cluster()
            assert stack.cluster is not None
            nodes = (
                f"{args.gpu_nodes} fake H200 nodes" if args.kwok else f"kubelet node {stack.node_names[0]}"
            )
            console.print(f"[green]ready[/] control plane at {stack.cluster.server}, {nodes}")
            if args.hold:
                await _hold(stack, console)
            else:
                # Its kubeconfig goes with it: paths printed now would name nothing by the time they are used.
                console.print("cleaning it up again; add --hold to keep it up and get its KUBECONFIG")
            return EXIT_OK
        await stack.start()
        scenario = Scenario(stack, Profile.quick() if args.quick else Profile(), console.log)
        results = await scenario.run()
        # Off the event loop: the controller and the agents are still running.
        summary = json.dumps(scenario.summary(), indent=1)
        await asyncio.to_thread((args.out / "summary.json").write_text, summary)
        console.print(table(results))
        why_not = await asyncio.to_thread(plot, scenario.timeline, args.out / "demo.png")
        console.print(why_not or f"plot: {args.out / 'demo.png'}")
        console.print(f"summary: {args.out / 'summary.json'}")
        if args.hold:
            await _hold(stack, console)
        return EXIT_OK
    except failures as e:
        console.print(f"[red]demo failed:[/] {e}")
        return EXIT_FAILED
    finally:
        with console.status("cleaning up"):
            await stack.stop()


async def _hold(stack: Stack, console: Console) -> None:
    """Print how to reach the running stack, then keep it up until SIGINT or SIGTERM."""
    assert stack.cluster is not None
    console.print(f"  export KUBECONFIG={stack.cluster.kubeconfig}")
    console.print(f"  export PATH={stack.cluster.components.bin_dir}:$PATH")
    console.print("holding; Ctrl-C to clean up")
    await _wait_for_signal()


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


if __name__ == "__main__":
    sys.exit(main())
