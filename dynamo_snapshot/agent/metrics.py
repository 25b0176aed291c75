"""The node agent's Prometheus metrics: checkpoint and restore phases, bytes, the node cache and the object
store."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PHASE_SECONDS = Histogram(
    "dynsnap_agent_phase_seconds",
    "Checkpoint/restore time by operation and phase",
    ["op", "phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
)
BYTES = Counter("dynsnap_agent_artifact_bytes_total", "Artifact bytes written or verified", ["op"])
FAILURES = Counter("dynsnap_agent_failures_total", "Failed checkpoints/restores", ["op"])
THROUGHPUT = Gauge("dynsnap_agent_io_gbps", "Artifact read/hash throughput of the last operation", ["op"])
PREFETCH_BYTES = Counter(
    "dynsnap_agent_prefetch_bytes_total", "Node-file bytes restores asked the kernel to read ahead"
)
PREFETCH_SKIPPED = Counter(
    "dynsnap_agent_prefetch_skipped_files_total",
    "Files of a prefetch plan missing or changed on this node (not read ahead)",
)
ZERO_PAGES_DROPPED = Counter(
    "dynsnap_agent_zero_page_bytes_dropped_total",
    "Bytes of all-zero anonymous pages left out of checkpoints' CRIU images",
)
ZERO_PAGES_RELEASED = Counter(
    "dynsnap_agent_zero_page_bytes_released_total",
    "Bytes of all-zero pages of the CUDA checkpoint's host copy workers gave back before the CRIU dump",
)
PAGES_STREAMED = Counter(
    "dynsnap_agent_streamed_page_bytes_total",
    "Bytes of memory pages restored trees got through the page server as the fetch brought them",
)
PAGES_COMPRESSED_SAVED = Counter(
    "dynsnap_agent_page_bytes_compressed_saved_total",
    "Bytes checkpoints' CRIU pages images shrank by being stored compressed",
)
CACHE_RESTORES = Counter(
    "dynsnap_agent_cache_restores_total",
    "Restores on a node with an artifact cache, by where the artifact was read: cache, store (the shared "
    "store, or fetched from the object store), or refused (the cached copy failed its check)",
    ["source"],
)
CACHE_FILLS = Counter(
    "dynsnap_agent_cache_fills_total",
    "Copies of artifacts into the node cache after a restore from the store: filled, no_room, failed",
    ["result"],
)
CACHE_EVICTIONS = Counter(
    "dynsnap_agent_cache_evictions_total",
    "Copies removed from the node cache to make room for another, the least recently restored first",
)
CACHE_BYTES = Gauge("dynsnap_agent_cache_bytes", "Bytes of artifacts in the node cache")
OBJECT_STORE_TRANSFERS = Counter(
    "dynsnap_agent_object_store_transfers_total",
    "Artifacts written to or fetched from the object store: op upload|fetch, result done|present|failed "
    "(present: the store, or this node, already held it)",
    ["op", "result"],
)
OBJECT_STORE_BYTES = Counter(
    "dynsnap_agent_object_store_bytes_total",
    "Artifact bytes sent to or fetched from the object store",
    ["op"],
)
