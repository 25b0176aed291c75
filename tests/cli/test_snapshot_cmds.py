"""`dynamo-snapshot inspect / restore` on artifacts of both key forms: the seal and the binding shown, an
edited manifest or an artifact bound elsewhere refused with one clear line (the CRIU round trip of these
commands is in tests/agent/test_cli.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from dynamo_snapshot.artifact import MANIFEST_NAME, ArtifactStore
from tests.artifact.helpers import BINDING, CHECKPOINT_UID, HASH, KEY, NAMESPACE, publish, sample_files
from tests.helpers.cli import run_cli


def _store(tmp_path: Path) -> ArtifactStore:
    """A store holding the same checkpoint twice: bound to ``BINDING``, and as a CLI artifact."""
    store = ArtifactStore(tmp_path / "store")
    asyncio.run(publish(store, sample_files(), binding=BINDING, extra={"control_dir": "/snapshot/control"}))
    asyncio.run(publish(store, sample_files()))
    return store


def test_inspect_shows_the_seal_and_the_binding(tmp_path: Path) -> None:
    store = _store(tmp_path)
    bound = store.open(KEY).manifest
    shown = run_cli("inspect", str(store.path_for(KEY)), "--verify")
    assert shown.returncode == 0, shown.stderr
    assert f"sealed: manifest digest {bound.digest}" in shown.stderr
    assert (
        f"bound to: DynamoCheckpoint {NAMESPACE}/{BINDING.checkpoint_name} (uid {CHECKPOINT_UID}), taken "
        f"from pod {BINDING.source_pod} (uid {BINDING.source_pod_uid})"
    ) in shown.stderr
    assert "verified" in shown.stderr
    printed = json.loads(shown.stdout)
    assert printed["digest"] == bound.digest
    assert printed["binding"] == BINDING.model_dump()

    cli = run_cli("inspect", str(store.path_for(HASH)))
    assert cli.returncode == 0, cli.stderr
    assert f"sealed: manifest digest {store.open(HASH).manifest.digest}" in cli.stderr
    assert f"bound to: no checkpoint (a CLI artifact of identity {HASH})" in cli.stderr
    assert "binding" not in json.loads(cli.stdout)


def test_inspect_refuses_an_edited_manifest(tmp_path: Path) -> None:
    store = _store(tmp_path)
    manifest = store.path_for(KEY) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes().replace(b'"/snapshot/control"', b'"/snapshot/contro1"'))
    shown = run_cli("inspect", str(store.path_for(KEY)))
    assert shown.returncode == 1
    assert "Traceback" not in shown.stderr
    assert "was changed after it was sealed" in shown.stderr
    # Copied out of the store, it is judged by its seal alone, and still refused.
    loose = tmp_path / "loose"
    shutil.copytree(store.path_for(KEY), loose)
    assert "was changed after it was sealed" in run_cli("inspect", str(loose)).stderr


def test_inspect_refuses_an_artifact_in_another_namespace_place(tmp_path: Path) -> None:
    store = _store(tmp_path)
    planted = store.root / "tenant-b" / CHECKPOINT_UID
    planted.parent.mkdir()
    shutil.copytree(store.path_for(KEY), planted)
    shown = run_cli("inspect", str(planted))
    assert shown.returncode == 1
    assert "Traceback" not in shown.stderr
    assert (
        f"binding mismatch: directory tenant-b/{CHECKPOINT_UID} holds an artifact bound to {KEY}"
        in " ".join(shown.stderr.split())
    )


def test_restore_takes_both_key_forms_and_names_them_when_neither(tmp_path: Path) -> None:
    neither = tmp_path / "store" / "tenant-a" / "not-a-uid"
    neither.mkdir(parents=True)
    refused = run_cli("restore", str(neither))
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr
    need = "need <store>/<identity hash> (16 lowercase hex digits) or <store>/<namespace>/<checkpoint uid>"
    assert need in refused.stderr


@pytest.mark.criu
def test_restore_refuses_an_edited_bound_artifact_before_criu_runs(criu_bin: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    manifest = store.path_for(KEY) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes().replace(b'"/snapshot/control"', b'"/snapshot/contro1"'))
    refused = run_cli(
        "restore", str(store.path_for(KEY)), env={**os.environ, "DYNSNAP_CRIU": str(criu_bin)}, timeout=120
    )
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr
    assert f"artifact {KEY} refused: {manifest} was changed after it was sealed" in refused.stderr
