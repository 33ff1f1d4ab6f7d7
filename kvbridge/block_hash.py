"""Chained block hashes: the single identity of KV everywhere.

hash(block i) = H(hash(block i-1), token ids of block i). The same hash keys the prefix
cache, the offload tiers and remote lookups, so it must be stable across processes and hosts:
it is a cryptographic digest, never Python's salted `hash()`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)

# Seeds the chain; a different namespace (model id) gives disjoint hashes.
_ROOT = b"kvbridge-block-hash-v1"


def root_hash(namespace: str = "") -> BlockHash:
    return BlockHash(hashlib.blake2b(_ROOT + namespace.encode(), digest_size=16).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes | None = None) -> BlockHash:
    """Hash of one full block given its parent's hash. `extra`: whatever besides the tokens decides the
    block's KV (an engine's cache salt, adapter, image hashes, as canonical bytes); None when nothing does,
    and then the hash is the tokens' alone, as every kvbridge engine computes it."""
    return _hash_ids(parent, np.asarray(token_ids, dtype=np.int64), extra)


def _hash_ids(parent: BlockHash, ids: np.ndarray, extra: bytes | None = None) -> BlockHash:
    """`ids`: one block's token ids as contiguous int64 (hashed as their bytes, no copy)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(ids)
    if extra is not None:  # a separator, then the length: tokens and extra keys never run into each other
        digest.update(b"\x00extra" + len(extra).to_bytes(8, "little"))
        digest.update(extra)
    return BlockHash(digest.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[BlockHash] = (),
    namespace: str = "",
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, extending the already-known prefix `known`."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root_hash(namespace)
    first = len(hashes) * block_size
    # One conversion for all new blocks (a 4,096-token prompt: 256 blocks), not one per block.
    ids = np.asarray(token_ids[first:], dtype=np.int64)
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = _hash_ids(parent, ids[start : start + block_size])
        hashes.append(parent)
    return hashes
