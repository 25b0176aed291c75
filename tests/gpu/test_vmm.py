"""VMM regions, KV cache and weights on a real GPU (the H200 machine): see vmm_scenarios.py for what each
scenario checks. Skipped unless cuda-python imports, cuInit succeeds and torch is there. Each test prints
its measurements as one JSON line (run with -s to see them).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from dynamo_snapshot.cuda import cuda_available
from tests.gpu import vmm_scenarios

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs cuda-python and an NVIDIA driver"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]


@pytest.mark.parametrize("name", list(vmm_scenarios.SCENARIOS))
def test_vmm(name: str, tmp_path: Path) -> None:
    line = vmm_scenarios.run(name, tmp_path)
    print(f"\n{json.dumps(line, default=str)}")
    assert line["status"] == "PASS", line.get("error")
