"""Every custom resource's REST location is read off its model, the place its CRD is generated from."""

from __future__ import annotations

from pathlib import Path

import yaml

from dynamo_snapshot.api.resources import CUSTOM_RESOURCES
from dynamo_snapshot.kube.kinds import CUSTOM_KINDS, POD_SNAPSHOT_CONTENT, kind_of

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_each_kind_is_where_its_crd_says() -> None:
    assert set(CUSTOM_KINDS) == {m.resource.kind for m in CUSTOM_RESOURCES}
    for model in CUSTOM_RESOURCES:
        kind = kind_of(model)
        crd = yaml.safe_load((CRDS / f"{kind.group}_{kind.plural}.yaml").read_text())
        names = crd["spec"]["names"]
        assert (crd["spec"]["group"], names["plural"], names["kind"]) == (kind.group, kind.plural, kind.kind)
        assert (
            kind.version in {v["name"] for v in crd["spec"]["versions"]}
            or kind.kind == "DynamoGraphDeployment"
        )
        assert kind.namespaced == (crd["spec"]["scope"] == "Namespaced")
    assert not POD_SNAPSHOT_CONTENT.namespaced
