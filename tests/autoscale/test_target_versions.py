"""Which DGD and DGDSA versions are read (v1beta1 where served, else v1alpha1), and which DGD CRDs each
install mode accepts."""

from __future__ import annotations

import pytest

from dynamo_snapshot.api import crdgen
from dynamo_snapshot.api.graphdeployment import DynamoGraphDeployment
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


def test_standalone_reads_its_own_crd_at_v1beta1_and_an_older_one_at_v1alpha1() -> None:
    # Ours as crds/ holds it: v1beta1 stored and served alone (v1alpha1 listed unserved).
    generated = crdgen.generated_crd(DynamoGraphDeployment)
    assert install_mode_problem(generated, STANDALONE) is None
    assert read_version(generated) == "v1beta1"
    # As an older release installed it, v1alpha1 alone.
    older = dgd_crd.ours()
    assert install_mode_problem(older, STANDALONE) is None
    assert read_version(older) == "v1alpha1"
    # Serving neither: refused, naming both.
    problem = install_mode_problem(dgd_crd.serving_only_an_unknown_version(older), STANDALONE)
    assert problem is not None
    assert "reads only v1alpha1 or v1beta1" in problem, problem
