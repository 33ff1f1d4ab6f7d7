"""What the prefix cache did this step, as vLLM's KV events (transfer/kv_event_messages.py).

Pure bookkeeping (no torch, no I/O). The block pool and the KV cache manager report to a
`KVEventRecorder` on the engine thread, in the order things happen:

* `blocks_stored(request, indices)`: the request's full blocks at `indices` entered the cache ->
  one `BlockStored` per run of adjacent indices, chained after the block before the run;
* `block_removed(block_hash)`: a cached block was evicted or forgotten -> `BlockRemoved`;
* `all_cleared()`: the prefix cache was reset -> `AllBlocksCleared`.

The engine takes the events after each step (`take_events`) and hands them to the publisher.
Hashes are vLLM's (`VllmBlockHasher`), computed here beside kvbridge's own: a request's vLLM chain
is kept while it holds blocks (`forget`), and the vLLM hash of every cached block while it is cached,
so an eviction names the hash that was published when the block was stored.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvbridge import env
from kvbridge.block_hash import BlockHash, VllmBlockHasher, external_block_hash
from kvbridge.config import KVEventsConfig
from kvbridge.transfer.kv_event_messages import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)


class HasTokens(Protocol):
    request_id: str
    block_hashes: list[BlockHash]

    @property
    def all_token_ids(self) -> list[int]: ...


class KVEventRecorder:
    """Turns prefix-cache changes into vLLM KV events, hashed as vLLM would hash the same tokens."""

    def __init__(self, hasher: VllmBlockHasher, block_size: int, int_hashes: bool = True, medium: str = MEDIUM_GPU):
        self.hasher = hasher
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.medium = medium
        self._chains: dict[str, list[bytes]] = {}  # request id -> vLLM digests of its blocks so far
        self._published: dict[BlockHash, int | bytes] = {}  # cached block (kvbridge hash) -> its event hash
        self._events: list[KVEvent] = []

    def blocks_stored(self, request: HasTokens, indices: list[int]) -> None:
        """The request's blocks at `indices` (ascending) were registered in the prefix cache."""
        if not indices:
            return
        tokens = request.all_token_ids
        chain = self._chains.setdefault(request.request_id, [])
        if len(chain) <= indices[-1]:
            chain[:] = self.hasher.hash_full_blocks(tokens[: (indices[-1] + 1) * self.block_size], self.block_size, chain)
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or indices[k] != indices[k - 1] + 1:
                self._store_run(request, chain, indices[run_start:k], tokens)
                run_start = k

    def _store_run(self, request: HasTokens, chain: list[bytes], run: list[int], tokens: list[int]) -> None:
        first, bs = run[0], self.block_size
        hashes = [external_block_hash(chain[i], self.int_hashes) for i in run]
        for i, published in zip(run, hashes):
            self._published[request.block_hashes[i]] = published
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=external_block_hash(chain[first - 1], self.int_hashes) if first else None,
                token_ids=list(tokens[first * bs : (run[-1] + 1) * bs]),
                block_size=bs,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                group_idx=0,  # one KV cache group, as vLLM's for a plain decoder
            )
        )

    def block_removed(self, block_hash: BlockHash) -> None:
        published = self._published.pop(block_hash, None)
        if published is not None:
            self._events.append(BlockRemoved(block_hashes=[published], medium=self.medium, group_idx=0))

    def all_cleared(self) -> None:
        self._published.clear()
        self._events.append(AllBlocksCleared())

    def forget(self, request_id: str) -> None:
        """The request released its blocks: its chain is not needed any more."""
        self._chains.pop(request_id, None)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    @property
    def num_published_blocks(self) -> int:
        """Blocks stored and not removed since: what subscribers believe this node caches."""
        return len(self._published)


class KVEventStream:
    """A recorder and the publisher its events go to: what an engine holds when KV events are on."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        from kvbridge.transfer.kv_event_publisher import ZmqEventPublisher

        hasher = VllmBlockHasher(config.prefix_caching_hash_algo, env.vllm_none_hash_seed())
        self.recorder = KVEventRecorder(hasher, block_size, int_hashes=env.vllm_kv_events_int_hashes())
        self.publisher = ZmqEventPublisher(config)

    def publish(self) -> None:
        """Publish what the prefix cache did since the last call, as one batch (none when nothing happened)."""
        events = self.recorder.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def get_stats(self) -> dict:
        publisher = self.publisher
        return {
            "prefix_caching_hash_algo": self.recorder.hasher.algo,
            "num_published_blocks": self.recorder.num_published_blocks,
            "num_batches_published": publisher.num_published,
            "num_batches_dropped": publisher.num_dropped,
        }

    def shutdown(self) -> None:
        self.publish()
        self.publisher.shutdown()
