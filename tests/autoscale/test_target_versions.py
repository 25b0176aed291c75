"""Which DGD and DGDSA versions are read beside NVIDIA's Dynamo operator, and which DGD CRDs each install
mode accepts (the operator's v1beta1 CRDs only in mode dynamo-operator)."""

from __future__ import annotations

import pytest

from dynamo_snapshot.autoscale.targets import read_version
from dynamo_snapshot.controller.config import InstallMode
from dynamo_snapshot.controller.install_mode import install_mode_problem
from tests.helpers import dgd_crd, dgdsa

STANDALONE, OPERATOR = InstallMode.STANDALONE, InstallMode.DYNAMO_OPERATOR


@pytest.mark.parametrize("also_v1alpha1", [False, True], ids=["v1beta1-only", "both"])
def test_the_operators_v1beta1_crd_runs_mode_dynamo_operator_read_at_v1beta1(also_v1alpha1: bool) -> None:
    crd = dgd_crd.operators_v1beta1(also_v1alpha1=also_v1alpha1)
    assert install_mode_problem(crd, OPERATOR) is None
    assert read_version(crd) == "v1beta1"


def test_a_v1alpha1_only_crd_is_read_at_v1alpha1() -> None:
    assert read_version(dgd_crd.operators()) == "v1alpha1"
    assert read_version(dgdsa.crd()) == "v1alpha1"


def test_a_crd_serving_neither_is_refused_in_both_modes() -> None:
    assert read_version(dgd_crd.serving_only_an_unknown_version(dgd_crd.operators())) is None
    assert read_version(None) is None
    problem = install_mode_problem(dgd_crd.serving_only_an_unknown_version(dgd_crd.operators()), OPERATOR)
    assert problem is not None
    assert "reads only v1alpha1 or v1beta1" in problem, problem


def test_standalone_still_reads_only_v1alpha1() -> None:
    # Our own CRD serving only v1beta1 (v1alpha1 kept unserved): mode standalone cannot run it.
    ours_beta = dgd_crd.operators_v1beta1()
    ours_beta["metadata"]["labels"] = dgd_crd.ours()["metadata"]["labels"]
    problem = install_mode_problem(ours_beta, STANDALONE)
    assert problem is not None
    assert "serves v1beta1, and this controller reads only v1alpha1:" in problem, problem
