"""Our protocol names against NVIDIA Dynamo's own (dynamo/common/snapshot/constants.py of the pinned
ai-dynamo wheel, installed by scripts/dynamo-wheels.sh): a Dynamo release that renames one fails here."""

from __future__ import annotations

import json

from dynamo_snapshot.api import protocol
from tests.helpers.dynamo import dynamo_site, run_dynamo_python

READ_DYNAMO = """
import json
from dynamo.common.snapshot import constants as c
print(json.dumps({
    "ready": c.READY_FOR_SNAPSHOT_FILE,
    "restore_complete": c.RESTORE_COMPLETE_FILE,
    "snapshot_complete": c.SNAPSHOT_COMPLETE_FILE,
    "control_dir_env": c.SNAPSHOT_CONTROL_DIR_ENV,
    "control_dir": c.SNAPSHOT_CONTROL_DIR,
    "restore_context": c.SNAPSHOT_RESTORE_CONTEXT_FILE,
    "standby_env": c.SNAPSHOT_RESTORE_STANDBY_ENV,
    "context_env": sorted(
        c.KUBERNETES_REQUIRED_ENV_NAMES | c.KUBERNETES_OPTIONAL_ENV_NAMES | c.RESTORE_RUNTIME_ENV_NAMES
    ),
}))
"""


def test_the_names_are_dynamos() -> None:
    proc = run_dynamo_python(dynamo_site(), READ_DYNAMO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dynamo = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dynamo["ready"] == protocol.FILE_READY_FOR_SNAPSHOT == protocol.FILES_READY[0]
    assert dynamo["restore_complete"] == protocol.FILE_RESTORE_COMPLETE
    assert dynamo["snapshot_complete"] == protocol.FILE_SNAPSHOT_COMPLETE
    assert dynamo["control_dir_env"] in protocol.ENV_CONTROL_DIRS
    assert dynamo["control_dir"] == protocol.CONTROL_MOUNT_PATH
    assert dynamo["restore_context"] == protocol.FILE_RESTORE_CONTEXT
    assert dynamo["standby_env"] in protocol.ENV_RESTORE_STANDBYS
    assert set(dynamo["context_env"]) == protocol.RESTORE_CONTEXT_ENV_NAMES
