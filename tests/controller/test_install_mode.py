"""The install mode against the DynamoGraphDeployment CRD: each contradiction refuses the controller's start
with its own message (logged, exit 1), read from the real apiserver with the CRD swapped for NVIDIA's
Dynamo operator's, for one serving only a version we do not read, or removed."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dynamo_snapshot.api import protocol
from dynamo_snapshot.controller.config import InstallMode
from dynamo_snapshot.controller.install_mode import DGD_CRD_NAME, install_mode_problem
from dynamo_snapshot_dev.localcluster import LocalCluster
from dynamo_snapshot_dev.localcluster.cluster import free_port
from tests.helpers import dgd_crd
from tests.helpers.cli import CLI, run_cli
from tests.helpers.polling import wait_for

STANDALONE, OPERATOR = InstallMode.STANDALONE, InstallMode.DYNAMO_OPERATOR
OWNER = f"{protocol.LABEL_CRD_OWNER}={protocol.MANAGED_BY_VALUE}"
# The message's fragment that says which contradiction it is, and the fragment that says what to set.
NOT_OURS = (
    "mode standalone creates the worker pods of every DynamoGraphDeployment, but the CRD "
    f"{DGD_CRD_NAME} is not dynamo-snapshot's (no label {OWNER}"
)
SET_OPERATOR = "set mode dynamo-operator (Helm value mode, or the controller's --mode / config key mode)"
OURS_IN_OPERATOR_MODE = (
    "mode dynamo-operator leaves the DynamoGraphDeployments to NVIDIA's Dynamo operator, but the CRD "
    f"{DGD_CRD_NAME} is dynamo-snapshot's own (label {OWNER})"
)
SET_STANDALONE = "set mode standalone (Helm value mode, or the controller's --mode / config key mode)"
NO_CRD = (
    "mode dynamo-operator runs beside NVIDIA's Dynamo operator, but the cluster has no "
    f"DynamoGraphDeployment CRD ({DGD_CRD_NAME}): install the Dynamo operator first"
)
UNKNOWN_VERSION = (
    f"the CRD {DGD_CRD_NAME} (another operator's) serves {dgd_crd.UNKNOWN_VERSION}, and this controller "
    "reads only v1alpha1"
)


# --------------------------------------------------------------------------- the decision, unit by unit


def test_each_mode_runs_with_the_crd_it_expects() -> None:
    assert install_mode_problem(dgd_crd.generated(), STANDALONE) is None
    assert install_mode_problem(dgd_crd.ours(), STANDALONE) is None
    assert install_mode_problem(dgd_crd.operators(), OPERATOR) is None
    # A CRD that serves v1alpha1 beside another version is read at v1alpha1.
    both = dgd_crd.serving_only_an_unknown_version(dgd_crd.operators())
    both["spec"]["versions"][0]["served"] = True
    assert install_mode_problem(both, OPERATOR) is None


@pytest.mark.parametrize(
    ("crd", "mode", "fragments"),
    [
        (dgd_crd.operators(), STANDALONE, [NOT_OURS, SET_OPERATOR]),
        (dgd_crd.ours(), OPERATOR, [OURS_IN_OPERATOR_MODE, SET_STANDALONE]),
        (None, OPERATOR, [NO_CRD, "or set mode standalone"]),
        (None, STANDALONE, ["mode standalone runs the DynamoGraphDeployments, but the cluster has no"]),
        (
            dgd_crd.serving_only_an_unknown_version(dgd_crd.operators()),
            OPERATOR,
            [UNKNOWN_VERSION, "install a Dynamo operator whose CRD serves v1alpha1"],
        ),
        (
            dgd_crd.serving_only_an_unknown_version(dgd_crd.ours()),
            STANDALONE,
            [f"the CRD {DGD_CRD_NAME} (dynamo-snapshot's) serves {dgd_crd.UNKNOWN_VERSION}"],
        ),
    ],
    ids=[
        "standalone-foreign",
        "operator-ours",
        "operator-none",
        "standalone-none",
        "operator-v9",
        "standalone-v9",
    ],
)
def test_each_contradiction_has_its_message(
    crd: dict[str, object] | None, mode: InstallMode, fragments: list[str]
) -> None:
    problem = install_mode_problem(crd, mode)
    assert problem is not None
    for fragment in fragments:
        assert fragment in problem, problem


def test_ownership_is_judged_before_the_version() -> None:
    # Our CRD in mode dynamo-operator is the wrong mode whatever it serves.
    problem = install_mode_problem(dgd_crd.serving_only_an_unknown_version(dgd_crd.ours()), OPERATOR)
    assert problem is not None
    assert OURS_IN_OPERATOR_MODE in problem


# --------------------------------------------------------------------------- the process, on the apiserver


def _start(cluster: LocalCluster, namespace: str, mode: InstallMode) -> subprocess.CompletedProcess[str]:
    """`dynamo-snapshot controller --mode MODE` as the cluster's admin; returns once it exits."""
    args = ["controller", "--kubeconfig", str(cluster.kubeconfig), "--mode", str(mode)]
    args += ["--namespace", namespace, "--no-leader-elect", "--metrics-port", "0", "--health-port", "0"]
    return run_cli(*args, timeout=60)


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("crd", "mode", "message"),
    [
        (dgd_crd.operators(), STANDALONE, NOT_OURS),
        (dgd_crd.ours(), OPERATOR, OURS_IN_OPERATOR_MODE),
        (None, OPERATOR, NO_CRD),
        (dgd_crd.serving_only_an_unknown_version(dgd_crd.operators()), OPERATOR, UNKNOWN_VERSION),
    ],
    ids=["standalone-foreign", "operator-ours", "operator-none", "operator-v9"],
)
def test_the_controller_refuses_to_start_with_the_message(
    cluster: LocalCluster,
    crds: list[str],
    namespace: str,
    crd: dict[str, object] | None,
    mode: InstallMode,
    message: str,
) -> None:
    with dgd_crd.dgd_crd_as(cluster, crd):
        proc = _start(cluster, namespace, mode)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The reason is logged (structured) and is the process's one-line error.
    logged = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    refusals = [r for r in logged if r.get("msg") == "install mode refused"]
    assert [(r["level"], r["mode"]) for r in refusals] == [("error", mode)], proc.stderr
    assert message in refusals[0]["reason"], proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("controller: InstallModeRefused: "), proc.stderr
    assert message in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("crd", "mode", "versions"),
    [
        (dgd_crd.generated(), STANDALONE, ["v1beta1"]),
        (dgd_crd.ours(), STANDALONE, ["v1alpha1"]),
        (dgd_crd.operators(), OPERATOR, ["v1alpha1"]),
    ],
    ids=["ours", "ours-of-an-older-release", "operators"],
)
def test_each_mode_starts_with_its_own_crd(
    cluster: LocalCluster,
    crds: list[str],
    namespace: str,
    tmp_path: Path,
    crd: dict[str, object],
    mode: InstallMode,
    versions: list[str],
) -> None:
    """No refusal where mode and CRD agree: the process gets as far as ready, reading DGDs at the version
    served (v1beta1 where it is), and stops cleanly."""
    port, log = free_port(), tmp_path / "controller.log"
    args = ["controller", "--kubeconfig", str(cluster.kubeconfig), "--mode", str(mode)]
    args += ["--namespace", namespace, "--no-leader-elect", "--metrics-port", "0", "--health-port", str(port)]
    with dgd_crd.dgd_crd_as(cluster, crd), log.open("w") as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=out)
        try:
            wait_for(lambda: _ready(port, proc, log), within=60, what=f"mode {mode} to be ready")
        finally:
            proc.terminate()
            rc = proc.wait(timeout=30)
    assert rc == 0, log.read_text()[-3000:]
    checked = [json.loads(line) for line in log.read_text().splitlines() if "install mode checked" in line]
    assert [(c["mode"], c["dgdCrdVersions"], c["dgdVersion"]) for c in checked] == [
        (mode, versions, versions[0])
    ]


def _ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> bool:
    assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
