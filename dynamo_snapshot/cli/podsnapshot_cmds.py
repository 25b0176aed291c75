"""`dynamo-snapshot snapshot POD` and `dynamo-snapshot snapshots`: PodSnapshots from the command line.

    dynamo-snapshot snapshot worker-0 -n inference             # PodSnapshot worker-0-snapshot (main)
    dynamo-snapshot snapshot worker-0 -n inference --wait 600  # and wait: exit 0 Ready, 1 Failed
    dynamo-snapshot snapshots -n inference                     # every PodSnapshot: pod, content, state,
                                                               # then every SnapshotJob's state
    dynamo-snapshot snapshots -A                               # in every namespace

The PodSnapshot pins the pod's UID, so a pod replaced under the same name is refused, not captured.

Exit codes: 0 done, 1 failed (one line says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from dynamo_snapshot.api.conditions import FAILED, READY
from dynamo_snapshot.api.kube import LABEL_VALUE_MAX_LENGTH
from dynamo_snapshot.api.protocol import API_GROUP, API_VERSION, DEFAULT_TARGET_CONTAINER
from dynamo_snapshot.api.snapshotjob import SnapshotJobCondition
from dynamo_snapshot.api.views import Meta, ObjectView, PodSnapshotView, PodView, SnapshotJobView
from dynamo_snapshot.kube import POD, ApiError, Kube, Obj, is_not_found, load_client
from dynamo_snapshot.kube.kinds import POD_SNAPSHOT, SNAPSHOT_JOB

SUFFIX = "-snapshot"
WAIT_POLL_S = 1.0


def register(sub: Any) -> None:
    doc = (__doc__ or "").split("\n\n")
    s: argparse.ArgumentParser = sub.add_parser(
        "snapshot",
        help="create a PodSnapshot of a running pod",
        description=doc[0],
        epilog="\n\n".join(doc[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("pod", help="the pod to capture")
    s.add_argument("-n", "--namespace", default="default", help="the pod's namespace (default: default)")
    s.add_argument("--container", help="the container to capture (default: main, or the pod's only one)")
    s.add_argument("--name", help=f"the PodSnapshot's name (default: POD{SUFFIX})")
    s.add_argument("--wait", type=float, metavar="SECONDS", help="wait until it is Ready or Failed")
    s.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    s.set_defaults(run=run_snapshot)

    ls: argparse.ArgumentParser = sub.add_parser(
        "snapshots",
        help="list PodSnapshots and SnapshotJobs and their state",
        description="List PodSnapshots and their state, then SnapshotJobs (when there are any) and theirs.",
    )
    scope = ls.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", default="default", help="namespace (default: default)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    ls.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    ls.set_defaults(run=run_list)


def run_snapshot(args: argparse.Namespace) -> int:
    return _run(_snapshot(args))


def run_list(args: argparse.Namespace) -> int:
    return _run(_list(args))


def _run(work: Any) -> int:
    try:
        code: int = asyncio.run(work)
    except (ApiError, OSError, ValueError) as e:
        print(f"dynamo-snapshot: {e}", file=sys.stderr)
        return 1
    return code


def snapshot_name(pod: str) -> str:
    """POD-snapshot, cut to fit a label value (what NVIDIA's snapshotctl does too)."""
    return (pod + SUFFIX)[:LABEL_VALUE_MAX_LENGTH].rstrip("-.")


def pick_container(pod: Obj, asked: str | None) -> str:
    view = PodView(pod)
    names = view.container_names
    if asked is not None:
        if asked not in names:
            raise ValueError(f"pod {view.meta.name} has no container {asked!r} (it has {', '.join(names)})")
        return asked
    if DEFAULT_TARGET_CONTAINER in names:
        return DEFAULT_TARGET_CONTAINER
    if len(names) == 1:
        return names[0]
    raise ValueError(
        f"pod {view.meta.name} has containers {', '.join(names)} and none is called "
        f"{DEFAULT_TARGET_CONTAINER!r}: name the one to capture with --container"
    )


async def _snapshot(args: argparse.Namespace) -> int:
    async with await load_client(args.kubeconfig) as api_client:
        kube = Kube(api_client, field_manager="dynamo-snapshot-cli")
        try:
            pod = await kube.get(POD, args.pod, args.namespace)
        except ApiError as e:
            if is_not_found(e):
                raise ValueError(f"pod {args.namespace}/{args.pod} does not exist") from None
            raise
        name = args.name or snapshot_name(args.pod)
        manifest = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "PodSnapshot",
            "metadata": {"name": name},
            "spec": {
                "source": {
                    "podRef": {
                        "name": args.pod,
                        "uid": Meta(pod).uid,
                        "containers": [pick_container(pod, args.container)],
                    }
                }
            },
        }
        await kube.create(POD_SNAPSHOT, manifest, args.namespace)
        print(f"podsnapshot/{name} created")
        if args.wait is None:
            return 0
        return await _wait(kube, args.namespace, name, args.wait)


async def _wait(kube: Kube, namespace: str, name: str, within: float) -> int:
    deadline = time.monotonic() + within
    while True:
        obj = await kube.get(POD_SNAPSHOT, name, namespace)
        state, reason, message = snapshot_state(obj)
        if state in ("Ready", "Failed"):
            print(f"podsnapshot/{name} {state}: {reason}: {message}")
            return 0 if state == "Ready" else 1
        if time.monotonic() > deadline:
            print(f"podsnapshot/{name} still {state} after {within:g} s: {message}", file=sys.stderr)
            return 1
        await asyncio.sleep(WAIT_POLL_S)


def snapshot_state(obj: Obj) -> tuple[str, str, str]:
    """(Ready | Failed | Pending, reason, message) from the PodSnapshot's conditions."""
    view = ObjectView(obj)
    for type_ in (FAILED, READY):
        if view.condition_true(type_):
            c = view.condition(type_)
            return type_, c.get("reason") or "", c.get("message") or ""
    ready = view.condition(READY)
    return "Pending", ready.get("reason") or "Pending", ready.get("message") or "not bound yet"


def snapshot_job_state(obj: Obj) -> tuple[str, str]:
    """(Completed | Failed | Capturing | Pending, reason) from the SnapshotJob's conditions."""
    view = ObjectView(obj)
    for type_ in (SnapshotJobCondition.COMPLETED, FAILED):
        if view.condition_true(type_):
            return type_, view.condition(type_).get("reason") or ""
    captured = view.condition(SnapshotJobCondition.CAPTURED)
    if captured:
        return "Capturing", captured.get("reason") or ""
    running = view.condition(SnapshotJobCondition.RUNNING)
    return "Pending", running.get("reason") or "-"


async def _list(args: argparse.Namespace) -> int:
    namespace = None if args.all_namespaces else args.namespace
    async with await load_client(args.kubeconfig) as api_client:
        kube = Kube(api_client, field_manager="dynamo-snapshot-cli")
        items, _ = await kube.list_all(POD_SNAPSHOT, namespace)
        jobs, _ = await kube.list_all(SNAPSHOT_JOB, namespace)
    rows = [("NAMESPACE", "NAME", "POD", "CONTAINER", "STATE", "REASON", "CONTENT")]
    for obj in sorted(items, key=_by_name):
        snapshot = PodSnapshotView(obj)
        state, reason, _ = snapshot_state(obj)
        rows.append(
            (
                snapshot.meta.namespace,
                snapshot.meta.name,
                snapshot.source.name,
                ",".join(snapshot.source.containers),
                state,
                reason,
                snapshot.bound_content or "-",
            )
        )
    _print_table(rows)
    if jobs:
        print()
        job_rows = [("NAMESPACE", "SNAPSHOTJOB", "STATE", "REASON", "PODSNAPSHOT")]
        for obj in sorted(jobs, key=_by_name):
            job = SnapshotJobView(obj)
            state, reason = snapshot_job_state(obj)
            job_rows.append((job.meta.namespace, job.meta.name, state, reason, job.pod_snapshot_name or "-"))
        _print_table(job_rows)
    return 0


def _by_name(obj: Obj) -> tuple[str, str]:
    meta = Meta(obj)
    return meta.namespace, meta.name


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
