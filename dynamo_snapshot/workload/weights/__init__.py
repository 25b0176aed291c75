"""Model weights kept out of the checkpoint: packed into one VmmRegion, saved once to a file laid out
for fast reads, released before the checkpoint and read back after the restore.

The CUDA checkpoint copies all device memory through host memory and CRIU writes it into the image; a
restore reads it back the same way. Weights do not need that trip: they are immutable and already
exist as a file. So the worker packs its weights into a WeightRegion (pack() copies the tensors in and
returns views; the model's parameters are re-pointed at them with `param.data = view`), saves the
region once (save()), releases it (release()), and after the restore load() maps new memory at the
same addresses and fills it from the file: parallel reads (O_DIRECT when the file is not in the page
cache) into a small ring of pinned host buffers, each handed to an asynchronous host-to-device copy as
soon as it is full, so reading and copying overlap.

    format      the file: prefix, JSON header (tensors, chunk digests, encoding), data; read_header
    codec       the split-nibble encoding of a chunk, in plain Python and on the GPU with torch
    engine      TransferEngine: bytes between the region and host buffers (TorchEngine: pinned, CUDA)
    pipeline    save and load pipelines: chunks hashed, encoded, written; records read and uploaded
    region      WeightRegion (pack, save, release, load), pack_module, SaveResult, LoadResult
    manifest    the control directory's weights.json (FILE_WEIGHTS_MANIFEST) and weights-verified
    arrival     weights still arriving after the restore (FILE_WEIGHTS_ARRIVED): reads wait for their bytes

The header's per-chunk SHA-256 digests are the file's integrity check: a load verifies them with
verify=True, and the node agent seals the file with the artifact's own chunk digests. weights.json lists
each file with its size and data digest (the digest of the header's chunk digests), so the agent can check
the file and warm the page cache with it (warm_page_cache) while CRIU restores the process.

torch is needed only to move bytes (pack, save, load use it through TransferEngine); everything else,
the format included, is plain Python.
"""

from dynamo_snapshot.fileio import WarmResult, page_cache_fraction, warm_page_cache
from dynamo_snapshot.workload.weights.arrival import (
    ArrivingReader,
    WeightsArrival,
    arrived_document,
    parse_arrived,
    weights_arriving,
)
from dynamo_snapshot.workload.weights.codec import count_escapes, decode_coded, encode_coded
from dynamo_snapshot.workload.weights.engine import HostBuffer, MmapBuffer, TransferEngine
from dynamo_snapshot.workload.weights.format import (
    ALIGN,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TENSOR_ALIGNMENT,
    ENCODING_RAW,
    ENCODING_SPLIT_NIBBLE,
    ENCODINGS,
    FORMAT_VERSION,
    MAGIC,
    NIBBLE_ESCAPE,
    NIBBLE_TABLE,
    PREFIX_BYTES,
    Encoding,
    TensorSpec,
    WeightsFileError,
    WeightsHeader,
    coded_record_bytes,
    data_digest,
    escape_limit,
    plan_layout,
    read_header,
)
from dynamo_snapshot.workload.weights.manifest import (
    FILE_WEIGHTS_MANIFEST,
    OffloadManifest,
    WeightsFile,
    parse_offload_manifest,
    read_offload_manifest,
    read_weights_manifest,
    wait_for_weights_verified,
    warm_weights,
    weights_check_pending,
    write_weights_manifest,
)
from dynamo_snapshot.workload.weights.region import (
    DEFAULT_BLOCK_BYTES,
    LoadResult,
    SaveResult,
    WeightRegion,
    pack_module,
)

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TENSOR_ALIGNMENT",
    "ENCODINGS",
    "ENCODING_RAW",
    "ENCODING_SPLIT_NIBBLE",
    "FILE_WEIGHTS_MANIFEST",
    "FORMAT_VERSION",
    "MAGIC",
    "NIBBLE_ESCAPE",
    "NIBBLE_TABLE",
    "PREFIX_BYTES",
    "ArrivingReader",
    "Encoding",
    "HostBuffer",
    "LoadResult",
    "MmapBuffer",
    "OffloadManifest",
    "SaveResult",
    "TensorSpec",
    "TransferEngine",
    "WarmResult",
    "WeightRegion",
    "WeightsArrival",
    "WeightsFile",
    "WeightsFileError",
    "WeightsHeader",
    "arrived_document",
    "coded_record_bytes",
    "count_escapes",
    "data_digest",
    "decode_coded",
    "encode_coded",
    "escape_limit",
    "pack_module",
    "page_cache_fraction",
    "parse_arrived",
    "parse_offload_manifest",
    "plan_layout",
    "read_header",
    "read_offload_manifest",
    "read_weights_manifest",
    "wait_for_weights_verified",
    "warm_page_cache",
    "warm_weights",
    "weights_arriving",
    "weights_check_pending",
    "write_weights_manifest",
]
