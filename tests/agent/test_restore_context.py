"""restore-context.json, which a restored Dynamo worker applies after restore-complete: the standby's own
is kept, else the agent writes the restore container's values of the names Dynamo carries. Pure files."""

from __future__ import annotations

import json
from pathlib import Path

from dynamo_snapshot.agent.restore import ensure_restore_context
from dynamo_snapshot.api import protocol


def test_the_agent_writes_the_restore_containers_values_with_nulls_for_the_rest(tmp_path: Path) -> None:
    env = {"POD_NAME": "worker-r1", "DYN_SYSTEM_PORT": "9090", "SECRET_TOKEN": "s3cr3t"}
    ensure_restore_context(tmp_path, env)
    written = json.loads((tmp_path / protocol.FILE_RESTORE_CONTEXT).read_text())
    assert set(written) == {"env"}
    assert set(written["env"]) == protocol.RESTORE_CONTEXT_ENV_NAMES
    assert written["env"]["POD_NAME"] == "worker-r1"
    assert written["env"]["DYN_SYSTEM_PORT"] == "9090"
    # Unset in the restore container: null, so the worker drops the checkpoint pod's stale value.
    assert written["env"]["DYN_NAMESPACE"] is None
    # Only the names Dynamo reads again: nothing else of the environment leaves the container.
    assert "SECRET_TOKEN" not in written["env"]


def test_a_standbys_own_context_is_kept(tmp_path: Path) -> None:
    own = {"env": {"POD_NAME": "resolved-by-kubernetes"}}
    (tmp_path / protocol.FILE_RESTORE_CONTEXT).write_text(json.dumps(own))
    ensure_restore_context(tmp_path, {"POD_NAME": "from-the-spec"})
    assert json.loads((tmp_path / protocol.FILE_RESTORE_CONTEXT).read_text()) == own
