"""File I/O for every layer above: big files moved and hashed at disk speed, writes made durable, the
page cache measured and filled. Nothing here knows about artifacts, CRIU images or weights; it imports
only the standard library.

    blocks      ALIGN, round_up, usable_cpus, pwrite_all, open_maybe_direct (O_DIRECT or not),
                transfer_block, DirectReader (parallel reads that fall back to buffered on EINVAL)
    bulk        copy_file, copy_tree, sha256_file (+ a-prefixed async forms) -> IoStats / TreeStats
    hashing     hash_files(HashJob...) -> FileDigests: per-chunk SHA-256 of many files on one pool;
                chunk_count, spans
    durable     fsync_dir, fsync_dirs, write_atomic, write_replacing (tmp file renamed over the old)
    pagecache   page_cache_fraction (mincore), warm_page_cache -> WarmResult
    ioprio      set_thread_ioprio / get_thread_ioprio (IDLE, BEST_EFFORT_DEFAULT)
"""

from dynamo_snapshot.fileio.blocks import (
    ALIGN,
    DirectReader,
    open_maybe_direct,
    pwrite_all,
    round_up,
    transfer_block,
    usable_cpus,
)
from dynamo_snapshot.fileio.bulk import (
    BLOCK_SIZE,
    INFLIGHT,
    PARALLEL_FILES,
    IoStats,
    TreeStats,
    acopy_file,
    acopy_tree,
    asha256_file,
    copy_file,
    copy_tree,
    in_thread,
    sha256_file,
)
from dynamo_snapshot.fileio.durable import fsync_dir, fsync_dirs, write_atomic, write_replacing
from dynamo_snapshot.fileio.hashing import (
    DEFAULT_CHUNK_BYTES,
    HASH_BLOCK_SIZE,
    HASH_PARALLEL,
    FileDigests,
    HashJob,
    ahash_files,
    chunk_count,
    hash_files,
    spans,
)
from dynamo_snapshot.fileio.pagecache import WarmResult, page_cache_fraction, warm_page_cache

__all__ = [
    "ALIGN",
    "BLOCK_SIZE",
    "DEFAULT_CHUNK_BYTES",
    "HASH_BLOCK_SIZE",
    "HASH_PARALLEL",
    "INFLIGHT",
    "PARALLEL_FILES",
    "DirectReader",
    "FileDigests",
    "HashJob",
    "IoStats",
    "TreeStats",
    "WarmResult",
    "acopy_file",
    "acopy_tree",
    "ahash_files",
    "asha256_file",
    "chunk_count",
    "copy_file",
    "copy_tree",
    "fsync_dir",
    "fsync_dirs",
    "hash_files",
    "in_thread",
    "open_maybe_direct",
    "page_cache_fraction",
    "pwrite_all",
    "round_up",
    "sha256_file",
    "spans",
    "transfer_block",
    "usable_cpus",
    "warm_page_cache",
    "write_atomic",
    "write_replacing",
]
