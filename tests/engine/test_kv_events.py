"""KV events from the prefix cache (engine/kv_events.py): what is stored, evicted, forgotten and reset, in
order, with vLLM's chained hashes. The publisher and the wire are tested in tests/transfer and tests/serve;
identity with vLLM's own hashes in tests/integrations/vllm/test_kv_events_golden.py."""

from __future__ import annotations

from kvbridge.block_hash import VllmBlockHasher, external_block_hash
from kvbridge.engine.kv_cache_manager import KVCacheManager
from kvbridge.engine.kv_events import KVEventRecorder
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.transfer.kv_event_messages import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
HASHER = VllmBlockHasher("sha256")


def _manager(num_blocks: int) -> tuple[KVCacheManager, KVEventRecorder]:
    kv = KVCacheManager(num_blocks, BS)
    recorder = KVEventRecorder(HASHER, BS)
    kv.record_events(recorder)
    return kv, recorder


def _run(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    """Allocate, compute and cache every full block of a prompt; the request keeps its blocks."""
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), BS)
    computed = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(tokens), computed)
    kv.cache_blocks(request, len(tokens))
    return request


def _vllm_hashes(tokens: list[int]) -> list[int]:
    return [external_block_hash(d) for d in HASHER.hash_full_blocks(tokens, BS)]


def test_a_computed_prompt_is_stored_once_with_its_chain_and_tokens():
    kv, recorder = _manager(16)
    tokens = list(range(1, 11))  # two full blocks and a partial one
    _run(kv, "a", tokens)
    (event,) = recorder.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == _vllm_hashes(tokens)
    assert event.parent_block_hash is None and event.token_ids == tokens[:8] and event.block_size == BS
    assert event.medium == "GPU" and event.group_idx == 0
    assert recorder.take_events() == []  # taken means gone
    kv.check_integrity()


def test_blocks_hit_in_the_cache_are_not_stored_again_and_a_tail_chains_after_its_parent():
    kv, recorder = _manager(16)
    _run(kv, "a", list(range(1, 9)))
    recorder.take_events()
    longer = list(range(1, 17))  # the same two blocks, then two more
    _run(kv, "b", longer)
    (event,) = recorder.take_events()
    all_hashes = _vllm_hashes(longer)
    assert event.block_hashes == all_hashes[2:]
    assert event.parent_block_hash == all_hashes[1]
    assert event.token_ids == longer[8:16]


def test_an_evicted_block_is_removed_under_the_hash_it_was_stored_with():
    kv, recorder = _manager(4)
    first = list(range(1, 17))  # fills the pool
    _run(kv, "a", first)
    kv.free("a")
    stored = recorder.take_events()[0].block_hashes
    _run(kv, "b", list(range(100, 108)))  # needs two blocks: evicts the two least recently freed
    events = recorder.take_events()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 2 and set(removed) <= set(stored)
    assert set(removed) == set(stored[2:])  # freed tail first: the tail goes first
    assert isinstance(events[-1], BlockStored)  # removals, then the new blocks, in the order they happened
    assert recorder.num_published_blocks == 4
    kv.check_integrity()


def test_forgotten_blocks_are_removed_and_a_reset_clears_everything():
    kv, recorder = _manager(16)
    tokens = list(range(1, 13))
    _run(kv, "a", tokens)
    recorder.take_events()
    kv.uncache_from("a", 1)  # a failed load: blocks 1.. hold wrong KV
    removed = recorder.take_events()
    assert [e.block_hashes for e in removed] == [[h] for h in _vllm_hashes(tokens)[1:]]
    kv.reset_prefix_cache()
    assert recorder.take_events() == [AllBlocksCleared()]
    assert recorder.num_published_blocks == 0


def test_without_a_recorder_the_cache_behaves_as_before():
    kv = KVCacheManager(8, BS)
    request = _run(kv, "a", list(range(1, 9)))
    assert kv.pool.num_cached_blocks == 2 and request.block_hashes
    kv.free("a")
    kv.reset_prefix_cache()
    kv.check_integrity()
