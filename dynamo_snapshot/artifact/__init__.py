"""The checkpoint artifact: a directory of data files sealed by a versioned ``manifest.json``.

    store = ArtifactStore(root)                     # root/<identity hash>/, nothing else from input
    store.path_for(h) / exists(h) / open(h) -> Artifact / list() -> [hash] / delete(h) -> bool
    store.gc_partial() -> [Path]                    # staging of dead writers, interrupted deletes

    with ArtifactWriter(store, h) as w:             # staging dir in the store, flock()ed while alive
        ... write files under w.directory (e.g. criu dump into it) ...
        await w.publish(criu_version=..., gpus=GpuInfo(...), identity=..., source_node=...,
                        timings=..., extra=...) -> PublishResult(artifact, won, io)
    # leaving the block unpublished (or w.discard()) removes the staging dir

    artifact.verify(*, check_checksums=True, expect_hash=None) -> TreeStats   # or ArtifactError;
    await artifact.averify(...)                                               # same, in a thread
    artifact.compatibility(node_gpus: GpuInfo | None) -> [problem]            # empty: restorable
    await fetch(artifact, local_store) -> PublishResult   # checked, atomic copy into a local cache

Large-file helpers (``dynamo_snapshot.artifact.io``): ``copy_file``, ``copy_tree``, ``sha256_file``
and their ``a``-prefixed async forms, reporting ``IoStats``/``TreeStats`` (bytes, seconds, gbps).
"""

from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.io import (
    IoStats,
    TreeStats,
    acopy_file,
    acopy_tree,
    asha256_file,
    copy_file,
    copy_tree,
    sha256_file,
)
from dynamo_snapshot.artifact.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    GpuInfo,
    Manifest,
    validate_identity_hash,
)
from dynamo_snapshot.artifact.reader import Artifact
from dynamo_snapshot.artifact.store import ArtifactStore
from dynamo_snapshot.artifact.writer import ArtifactWriter, PublishResult, fetch

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Artifact",
    "ArtifactError",
    "ArtifactNotFoundError",
    "ArtifactStore",
    "ArtifactWriter",
    "FileEntry",
    "GpuInfo",
    "IoStats",
    "Manifest",
    "PublishResult",
    "TreeStats",
    "acopy_file",
    "acopy_tree",
    "asha256_file",
    "copy_file",
    "copy_tree",
    "fetch",
    "sha256_file",
    "validate_identity_hash",
]
