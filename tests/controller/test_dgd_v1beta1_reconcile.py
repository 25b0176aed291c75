"""A DGD created at v1beta1 (Dynamo's upstream example, unchanged) is stored at v1alpha1 through the
conversion webhook and run by the standalone controller, which reads v1alpha1: its pods are created."""

from __future__ import annotations

from pathlib import Path

import yaml

from dynamo_snapshot.api import protocol
from dynamo_snapshot.localcluster import LocalCluster
from tests.controller.conftest import Harness, eventually
from tests.helpers.dgd_conversion import kubectl, v1beta1_served

EXAMPLE = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "api" / "fixtures" / "dgd_v1beta1" / "vllm-agg.yaml").read_text(
        encoding="utf-8"
    )
)


async def test_a_v1beta1_created_dgd_gets_its_pods(
    cluster: LocalCluster, harness: Harness, tmp_path: Path
) -> None:
    async with v1beta1_served(cluster, harness.kube, harness.namespace, tmp_path):
        proc = await kubectl(cluster, "create", "-n", harness.namespace, "-f", "-", body=EXAMPLE)
        assert proc.returncode == 0, proc.stderr

        async def pods_of_each_component() -> set[str]:
            pods = await harness.pods("vllm-agg")
            found = {p["metadata"]["labels"].get(protocol.LABEL_SERVICE, "") for p in pods}
            return found if found >= {"Frontend", "VllmDecodeWorker"} else set()

        assert await eventually(pods_of_each_component, within=60)
