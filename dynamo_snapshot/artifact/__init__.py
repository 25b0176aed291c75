"""The checkpoint artifact: a directory of data files sealed by a versioned, self-sealed ``manifest.json``.

    key = artifact_key(namespace, checkpoint_uid)   # "<namespace>/<uid>"; CLI artifacts: the identity hash
    validate_artifact_key(value) -> key             # ValueError for anything else: the traversal gate
    store = ArtifactStore(root)                     # root/<key>/, nothing else from input
    store.path_for(k) / exists(k) / open(k) -> Artifact / list() -> [key] / delete(k) -> bool
    store.gc_partial() -> [Path]                    # staging of dead writers, interrupted deletes

    with ArtifactWriter(store, h, key=k) as w:      # staging dir in the store, flock()ed while alive
        ... write files under w.directory (e.g. criu dump into it) ...
        await w.publish(criu_version=..., gpus=GpuInfo(...), identity=..., source_node=...,
                        timings=..., extra=..., binding=Binding(...)) -> PublishResult(artifact, won, io)
    # leaving the block unpublished (or w.discard()) removes the staging dir

    artifact.manifest.digest                        # SHA-256 of the manifest itself (format >= 3)
    artifact.manifest.binding                       # namespace, checkpoint name/uid, source pod (or None)

    artifact.verify(*, check_checksums=True, expect_hash=None, files=None) -> TreeStats  # or ArtifactError
    await artifact.averify(...)                                               # same, in a thread
    verify_files(root, entries, parallel=HASH_PARALLEL) -> TreeStats          # just these entries
    artifact.compatibility(node_gpus: GpuInfo | None) -> [problem]            # empty: restorable
    await fetch(artifact, local_store) -> PublishResult   # checked, atomic copy into a local cache
    cache = ArtifactCache(root, max_bytes)          # node-local copies: lookup(source) / fill(source)

A file larger than ``DEFAULT_CHUNK_BYTES`` (64 MiB) is sealed as one SHA-256 per chunk
(``FileEntry.chunks``), so sealing, verifying and fetching spread even one huge file over
``HASH_PARALLEL`` threads; smaller files keep one whole-file ``sha256``.

The hashing and copying underneath are ``dynamo_snapshot.fileio``'s (``hash_files``, ``copy_tree``, …,
reporting ``TreeStats``). Verifying and sealing hash big files in a helper process
(``dynamo_snapshot.artifact.isolated``; ``warm_up_hashing`` starts one ahead of time).
"""

from dynamo_snapshot.artifact.cache import ArtifactCache, CacheFull
from dynamo_snapshot.artifact.errors import ArtifactError, ArtifactNotFoundError
from dynamo_snapshot.artifact.isolated import warm_up as warm_up_hashing
from dynamo_snapshot.artifact.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Binding,
    FileEntry,
    GpuInfo,
    Manifest,
    validate_identity_hash,
)
from dynamo_snapshot.artifact.reader import Artifact, verify_files
from dynamo_snapshot.artifact.store import ArtifactStore, artifact_key, validate_artifact_key
from dynamo_snapshot.artifact.verified import VerifiedFiles
from dynamo_snapshot.artifact.writer import ArtifactWriter, PublishResult, fetch

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Artifact",
    "ArtifactCache",
    "ArtifactError",
    "ArtifactNotFoundError",
    "ArtifactStore",
    "ArtifactWriter",
    "Binding",
    "CacheFull",
    "FileEntry",
    "GpuInfo",
    "Manifest",
    "PublishResult",
    "VerifiedFiles",
    "artifact_key",
    "fetch",
    "validate_artifact_key",
    "validate_identity_hash",
    "verify_files",
    "warm_up_hashing",
]
