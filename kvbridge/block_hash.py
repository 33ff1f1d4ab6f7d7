"""Chained block hashes: the single identity of KV everywhere.

hash(block i) = H(hash(block i-1), token ids of block i). The same hash keys the prefix
cache, the offload tiers and remote lookups, so it must be stable across processes and hosts:
it is a cryptographic digest, never Python's salted `hash()`.

vLLM hashes the same blocks its own way; nodes that publish KV events compute that chain too
(`VllmBlockHasher`, below), so routers built for vLLM score kvbridge nodes correctly.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import NewType

import numpy as np

from kvbridge.errors import ConfigError

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


# ---------------------------------------------------------------------------------------------------
# vLLM's block hashes, for the KV events routers read (transfer/kv_event_messages.py).
#
# A router built for vLLM (vllm-router's kv_aware policy, llm-d, Dynamo) hashes a prompt's blocks the
# way vLLM's prefix cache does (vllm/v1/core/kv_cache_utils.py, hash_block_tokens) and looks the hashes
# up in the events each node published. kvbridge keys its own cache with the chain above; a node that
# publishes events computes vLLM's chain beside it, here and nowhere else:
#
#   NONE_HASH   = H(seed)                      seed: $PYTHONHASHSEED, else "vllm-none-hash"
#   hash(block) = H((parent or NONE_HASH, tuple(token_ids), extra_keys))
#
# H is `--prefix-caching-hash-algo`: "sha256" (vLLM's default) digests the object's pickle (protocol
# HIGHEST_PROTOCOL, as vLLM does; we only ever *dump* our own tuple of bytes and ints, never load
# anything), "sha256_cbor" its canonical CBOR (needs `cbor2`). vLLM seeds the xxhash algorithms with
# random bytes per process unless PYTHONHASHSEED is set: no router can match those, so they are
# accepted only with PYTHONHASHSEED. Events carry the low 64 bits of the digest as an int
# (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, vLLM's default 1) or the digest's bytes.
# ---------------------------------------------------------------------------------------------------

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
ExternalBlockHash = int | bytes  # what a KV event carries: vLLM's `ExternalBlockHash`


def _vllm_serialize(algo: str, obj: object) -> bytes:
    if algo.endswith("_cbor"):
        try:
            import cbor2
        except ImportError:
            raise ConfigError(f"--prefix-caching-hash-algo {algo} needs the cbor2 package: pip install cbor2") from None
        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class VllmBlockHasher:
    """vLLM's chained block hashes for one hash algorithm and seed (see the comment above)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in VLLM_HASH_ALGOS:
            raise ConfigError(f"--prefix-caching-hash-algo {algo!r}: expected one of {', '.join(VLLM_HASH_ALGOS)}")
        if algo.startswith("xxhash") and seed is None:
            raise ConfigError(
                f"--prefix-caching-hash-algo {algo}: vLLM seeds it with random bytes per process unless "
                "PYTHONHASHSEED is set, so no router could match these hashes; set PYTHONHASHSEED to the value "
                "the fleet uses, or use sha256"
            )
        self.algo = algo
        self.seed = VLLM_DEFAULT_NONE_HASH_SEED if seed is None else seed
        _vllm_serialize(algo, 0)  # a missing cbor2 is a start-up error, not a failed step
        self.none_hash = self._digest(self.seed)

    def _digest(self, obj: object) -> bytes:
        data = _vllm_serialize(self.algo, obj)
        if self.algo.startswith("xxhash"):
            import xxhash

            return xxhash.xxh3_128_digest(data)
        return hashlib.sha256(data).digest()

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        """vLLM's hash of one full block after `parent` (None: the first block), with no extra keys
        (no LoRA, multimodal input, cache salt or prompt embeddings: what kvbridge serves)."""
        return self._digest((parent or self.none_hash, tuple(int(t) for t in token_ids), None))

    def hash_full_blocks(self, token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
        """Hashes of every full block of `token_ids`, extending the already-known prefix `known`."""
        hashes = list(known)
        for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
            hashes.append(self.hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
        return hashes


def external_block_hash(digest: bytes, as_int: bool = True) -> ExternalBlockHash:
    """The hash a KV event carries for `digest`: vLLM's `maybe_convert_block_hash`."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1) if as_int else digest
