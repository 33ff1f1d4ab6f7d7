"""vLLM's KV-event wire format, mirrored field for field (vllm/distributed/kv_events.py).

Routers built for vLLM (vllm-router's `kv_aware` policy, llm-d's KV-cache indexer, Dynamo's KV
router) subscribe to each node's ZMQ publisher and decode these messages with vLLM's own classes,
so the schema here is vLLM's, not ours: same class names (they are the msgpack tags), same
fields in the same order, same struct options. It lives apart from `messages.py`, which holds
kvbridge's own protocol and its evolution rules; this one evolves only as vLLM's does, and the
golden test (tests/integrations/vllm/test_kv_events_golden.py) decodes our bytes with vLLM's classes.

One batch per engine step, encoded with msgpack:

    KVEventBatch = [ts, [event, ...], data_parallel_rank]          (array_like)
    event        = {"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared", ...fields}

Block hashes are vLLM's (kvbridge/block_hash.py, `VllmBlockHasher`): the low 64 bits as an int
by default, else the digest's bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.block_hash import ExternalBlockHash

MEDIUM_GPU = "GPU"  # the engine's own KV cache (vLLM says GPU whatever the device is)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were taken
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: `block_hashes[i]` holds `token_ids[i*block_size:(i+1)*block_size]`,
    chained after `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted, or forgotten because their KV was wrong)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset: forget every block of this node."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """Decode one payload frame; raises msgspec.DecodeError on anything else (subscribers, tests)."""
    return _decoder.decode(data)
