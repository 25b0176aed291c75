"""crds/ must be exactly what the generator makes from the models."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_snapshot.api import crdgen

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"


def test_crds_directory_matches_the_models() -> None:
    problems = crdgen.stale_files(CRD_DIR)
    assert problems == [], (
        "crds/ is out of date with dynamo_snapshot/api; regenerate with "
        "`python -m dynamo_snapshot.api.crdgen`:\n" + "\n".join(problems)
    )


def test_every_rendered_crd_is_in_the_directory() -> None:
    for name, text in crdgen.render_crds().items():
        assert (CRD_DIR / name).read_text(encoding="utf-8") == text


def test_rendering_is_deterministic() -> None:
    assert crdgen.render_crds() == crdgen.render_crds()
    assert sorted(crdgen.render_crds()) == [
        "nvidia.com_dynamocheckpoints.yaml",
        "nvidia.com_dynamographdeployments.yaml",
        "nvidia.com_dynamoscalingpolicies.yaml",
        "nvidia.com_podsnapshotcontents.yaml",
        "nvidia.com_podsnapshots.yaml",
        "nvidia.com_snapshotjobs.yaml",
    ]


def test_check_reports_drift_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    assert "nvidia.com_dynamocheckpoints.yaml: missing" in capsys.readouterr().err

    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0

    edited = tmp_path / "nvidia.com_dynamographdeployments.yaml"
    edited.write_text(edited.read_text(encoding="utf-8").replace("dgd", "dg"), encoding="utf-8")
    (tmp_path / "nvidia.com_retired.yaml").write_text(crdgen.GENERATED_HEADER + "kind: X\n", encoding="utf-8")
    (tmp_path / "hand-written.yaml").write_text("kind: Y\n", encoding="utf-8")
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "nvidia.com_dynamographdeployments.yaml: differs from the models" in err
    assert "nvidia.com_retired.yaml: generated, but no model produces it any more" in err
    assert "hand-written.yaml" not in err
    assert "python -m dynamo_snapshot.api.crdgen" in err

    assert crdgen.write_crds(tmp_path) == [edited]
    assert crdgen.write_crds(tmp_path) == []
