"""The CUDA checkpoint API on a real GPU (the H200 machine): see cuda_scenarios.py for what each checks.

Skipped unless cuda-python imports and cuInit succeeds, and torch is there for the worker. Each test
prints its measurements as one JSON line (run with -s to see them).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dynamo_snapshot.cuda import cuda_available
from tests.gpu import cuda_scenarios, rank_scenarios

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs cuda-python and an NVIDIA driver"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the CUDA worker needs torch"),
]


SCENARIOS = {**cuda_scenarios.SCENARIOS, **rank_scenarios.SCENARIOS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cuda_checkpoint(name: str, tmp_path: Path) -> None:
    report = SCENARIOS[name](tmp_path)
    print(f"\n{name}: {json.dumps(report, default=str)}")


def _criu_missing() -> bool:
    from dynamo_snapshot.criu import CriuError, find_criu

    try:
        find_criu()
    except CriuError:
        return True
    return False


@pytest.mark.skipif(_criu_missing(), reason="needs CRIU")
@pytest.mark.parametrize("name", list(rank_scenarios.CRIU_SCENARIOS))
def test_cuda_checkpoint_with_criu(name: str, tmp_path: Path) -> None:
    report = rank_scenarios.CRIU_SCENARIOS[name](tmp_path)
    print(f"\n{name}: {json.dumps(report, default=str)}")
