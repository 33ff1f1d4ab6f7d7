"""A checkpoint's identity: what its KV depends on, computed from its files, not from its path.

The identity (`model_id`) namespaces the chained block hashes, enters the compatibility hash that
P/D peers compare in the handshake, and stamps every disk-tier file. So two checkpoints whose
weights differ must never share it, and the same checkpoint must have one identity wherever it
lies: copied to another host, or to another directory. It is therefore computed from content:

    "<architecture>:<32 hex of sha256 over>"
        config.json, whole                                 (geometry, rope, norms)
        per weight file, in name order:
            its name and size
            its safetensors header, whole                  (tensor names, dtypes, shapes, offsets)
            its data: every byte when the file is at most FULL_HASH_MAX_BYTES,
                      else SAMPLE_BYTES at the start, middle and end of every tensor

The directory's name or path is left out on purpose: it says nothing about the weights (a new
checkpoint downloaded over the old one keeps the path) and would split one checkpoint into several
identities (two hosts, two mount points) that cannot share KV. The tokenizer is left out too: KV
is keyed by token ids, which the block hashes cover.

Why hash every byte only up to FULL_HASH_MAX_BYTES: the loader reads each file once anyway, and a
full hash of a small file costs less than its load, so small checkpoints (tests, the tiny models,
small shards) get an exact identity: one changed value anywhere changes it. A large shard (HF
writes 2-10 GB shards) would add seconds of hashing per shard at every start, so it is sampled
per tensor instead. Sampling is exact for changes that reach the header (a shape, a dtype, a tensor
added or renamed) and for any tensor whose values change broadly (a fine-tune, other seeds, a
re-quantization: all three windows of that tensor change, 3 x 4 KiB of every tensor, never missed).
What sampling can miss is an edit confined to a few values of one large tensor in a large file
(e.g. a few embedding rows trained in place): a window covers such an edit with probability of
about 12 KiB / the tensor's size. For checkpoints edited that way, KVBRIDGE_CHECKPOINT_FULL_HASH=1
hashes every byte of every file (set it alike on every node: the identity differs between modes).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from kvbridge import env
from kvbridge.errors import ModelLoadError

FULL_HASH_MAX_BYTES = 256 << 20  # files up to this size are hashed whole (see the module docstring)
SAMPLE_BYTES = 4096  # per window; three windows (start, middle, end) per tensor
_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own bound on the JSON header
_U64 = struct.Struct("<Q")


def checkpoint_id(config_path: str, weight_files: list[str]) -> str:
    """The identity of a checkpoint made of `config_path` (config.json) and its safetensors files."""
    digest = hashlib.sha256()
    with open(config_path, "rb") as f:
        config_bytes = f.read()
    _update(digest, b"config.json", config_bytes)
    full = env.checkpoint_full_hash()
    for path in sorted(weight_files, key=os.path.basename):
        _update(digest, b"file", os.path.basename(path).encode(), _file_digest(path, full))
    return f"{_architecture(config_bytes)}:{digest.hexdigest()[:32]}"


def _file_digest(path: str, full: bool) -> bytes:
    """sha256 of one safetensors file: its size, header and data (all of it, or windows per tensor)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = _read_header(f, path, size)
        _update(digest, _U64.pack(size), header)
        if full or size <= FULL_HASH_MAX_BYTES:
            f.seek(0)
            digest.update(hashlib.file_digest(f, "sha256").digest())
            return digest.digest()
        data_start = _U64.size + len(header)
        for begin, end in _tensor_ranges(header, path):
            for offset in _windows(begin, end):
                f.seek(data_start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, end - offset)))
    return digest.digest()


def _read_header(f, path: str, size: int) -> bytes:
    raw = f.read(_U64.size)
    if len(raw) != _U64.size:
        raise ModelLoadError(f"{path} is not a safetensors file (shorter than its header length)")
    (length,) = _U64.unpack(raw)
    if length > min(_MAX_HEADER_BYTES, size - _U64.size):
        raise ModelLoadError(f"{path} is not a safetensors file (header of {length} B in a {size} B file)")
    return f.read(length)


def _tensor_ranges(header: bytes, path: str) -> list[tuple[int, int]]:
    """(begin, end) byte offsets of every tensor's data, relative to the end of the header."""
    try:
        entries = json.loads(header)
        ranges = [tuple(v["data_offsets"]) for k, v in entries.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: unreadable safetensors header ({exc}); re-export the checkpoint") from None
    return sorted((int(b), int(e)) for b, e in ranges)


def _windows(begin: int, end: int) -> list[int]:
    """Start offsets of the windows that sample the tensor stored at [begin, end)."""
    if end - begin <= 3 * SAMPLE_BYTES:
        return list(range(begin, end, SAMPLE_BYTES))  # small: every byte
    return [begin, (begin + end - SAMPLE_BYTES) // 2, end - SAMPLE_BYTES]


def _architecture(config_bytes: bytes) -> str:
    """A readable prefix: the first `architectures` entry (validated by the loader, not here)."""
    try:
        archs = json.loads(config_bytes).get("architectures") or ["checkpoint"]
        return str(archs[0])
    except (ValueError, AttributeError, IndexError):
        return "checkpoint"


def _update(digest, *parts: bytes) -> None:
    """Length-prefixed parts, so that no two different sequences of parts hash alike."""
    for part in parts:
        digest.update(_U64.pack(len(part)))
        digest.update(part)
