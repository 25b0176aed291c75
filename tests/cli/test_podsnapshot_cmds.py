"""`dynamo-snapshot snapshot POD` and `dynamo-snapshot snapshots` against the real apiserver: the PodSnapshot
made pins the pod's UID and its container, the list shows each one's state (and each SnapshotJob's), and a
missing pod or container is one clear line with exit code 1."""

from __future__ import annotations

import json

import pytest

from dynamo_snapshot.api.podsnapshot import PodSnapshot
from dynamo_snapshot.cli.podsnapshot_cmds import (
    pick_container,
    snapshot_job_state,
    snapshot_name,
    snapshot_state,
)
from dynamo_snapshot_dev.localcluster import LocalCluster
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.cluster


def _pod(cluster: LocalCluster, namespace: str, name: str, *containers: str) -> dict[str, object]:
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": c, "image": "worker:1"} for c in containers],
            "nodeSelector": {"dynamo-snapshot.test/nowhere": "true"},  # stays unscheduled: not run
        },
    }
    cluster.apply(manifest, namespace)
    got: dict[str, object] = json.loads(
        cluster.kubectl("get", "-n", namespace, "pod", name, "-o", "json").stdout
    )
    return got


def test_snapshot_creates_a_podsnapshot_pinned_to_the_pod(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    pod = _pod(cluster, namespace, "worker-0", "sidecar", "main")
    kubeconfig = str(cluster.kubeconfig)
    made = run_cli("snapshot", "worker-0", "-n", namespace, "--kubeconfig", kubeconfig)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "podsnapshot/worker-0-snapshot created"
    stored = json.loads(
        cluster.kubectl("get", "-n", namespace, "podsnapshot", "worker-0-snapshot", "-o", "json").stdout
    )
    snapshot = PodSnapshot.model_validate(stored)
    ref = snapshot.spec.source.pod_ref
    assert (ref.name, ref.uid, ref.containers) == ("worker-0", pod["metadata"]["uid"], ["main"])  # type: ignore[index]

    listed = run_cli("snapshots", "-n", namespace, "--kubeconfig", kubeconfig)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAMESPACE", "NAME", "POD", "CONTAINER", "STATE", "REASON", "CONTENT"]
    assert row.split()[:5] == [namespace, "worker-0-snapshot", "worker-0", "main", "Pending"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("absent",), "does not exist"),
        (("worker-1", "--container", "engine"), "has no container 'engine' (it has a, b)"),
        (("worker-1",), "name the one to capture with --container"),
    ],
)
def test_bad_requests_say_why_in_one_line(
    cluster: LocalCluster, crds: list[str], namespace: str, args: tuple[str, ...], message: str
) -> None:
    _pod(cluster, namespace, "worker-1", "a", "b")
    proc = run_cli("snapshot", *args, "-n", namespace, "--kubeconfig", str(cluster.kubeconfig))
    assert proc.returncode == 1
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_names_containers_and_states() -> None:
    assert snapshot_name("worker-0") == "worker-0-snapshot"
    assert len(snapshot_name("w" * 70)) == 63
    one = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "engine"}]}}
    assert pick_container(one, None) == "engine"
    failed = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "SourcePodNotFound", "message": "gone"},
                {"type": "Failed", "status": "True", "reason": "SourcePodNotFound", "message": "gone"},
            ]
        }
    }
    assert snapshot_state(failed) == ("Failed", "SourcePodNotFound", "gone")
    assert snapshot_state({}) == ("Pending", "Pending", "not bound yet")


def test_snapshots_lists_snapshot_jobs_after_the_podsnapshots(
    cluster: LocalCluster, crds: list[str], namespace: str
) -> None:
    job = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "SnapshotJob",
        "metadata": {"name": "warm"},
        "spec": {
            "podSnapshotTemplate": {},
            "podTemplate": {"spec": {"containers": [{"name": "main", "image": "w:1"}]}},
        },
    }
    cluster.apply(job, namespace)
    listed = run_cli("snapshots", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["NAMESPACE", "NAME"]  # no PodSnapshots: the header alone
    assert lines[1] == ""
    assert lines[2].split() == ["NAMESPACE", "SNAPSHOTJOB", "STATE", "REASON", "PODSNAPSHOT"]
    assert lines[3].split() == [namespace, "warm", "Pending", "-", "-"]  # no controller runs here


def _job_status(*conds: tuple[str, str, str]) -> dict[str, object]:
    return {"status": {"conditions": [{"type": t, "status": s, "reason": r} for t, s, r in conds]}}


def test_snapshot_job_states() -> None:
    assert snapshot_job_state({}) == ("Pending", "-")
    assert snapshot_job_state(_job_status(("Running", "False", "PodPending"))) == ("Pending", "PodPending")
    capturing = _job_status(("Running", "True", "PodReady"), ("Captured", "False", "CaptureInProgress"))
    assert snapshot_job_state(capturing) == ("Capturing", "CaptureInProgress")
    done = _job_status(("Captured", "True", "CaptureCompleted"), ("Completed", "True", "JobCompleted"))
    assert snapshot_job_state(done) == ("Completed", "JobCompleted")
    failed = _job_status(("Captured", "False", "DeadlineExceeded"), ("Failed", "True", "DeadlineExceeded"))
    assert snapshot_job_state(failed) == ("Failed", "DeadlineExceeded")
