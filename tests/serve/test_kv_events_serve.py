"""`kvbridge serve --kv-events-config` as a router sees it: a real node, a plain ZMQ SUB socket, the node's
ROUTER replay socket. Every block the prefix cache stores and evicts, and every reset, is published in
vLLM's format, with sequence numbers from 0 and hashes chained as vLLM chains them (identity with vLLM's
own hash functions: tests/integrations/vllm/test_kv_events_golden.py)."""

from __future__ import annotations

import random
import subprocess
import tempfile

from kv_event_subscriber import KVEventSubscriber

from kvbridge.block_hash import VllmBlockHasher, external_block_hash
from kvbridge.serve.launcher import cli_argv, free_ports, http_json, start_node, wait_healthy
from kvbridge.transfer.kv_event_messages import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # four 100-token requests fill it: the fifth evicts
PROMPT_LEN = 100


def _complete(url: str, prompt: list[int]) -> None:
    status, body = http_json(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout_s=60)
    assert status == 200, body


def test_a_node_publishes_stores_evictions_and_resets_with_vllm_hashes_and_replays_them():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 384) for _ in range(PROMPT_LEN)] for _ in range(6)]
    hasher = VllmBlockHasher("sha256")
    with KVEventSubscriber(topic="kv@node") as sub, tempfile.TemporaryDirectory() as log_dir:
        config, replay_endpoint = sub.node_config()
        args = ["--no-connector", "--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "256",
                "--kv-events-config", config]  # fmt: skip
        node = start_node("events", "both", log_dir, extra_args=args)
        try:
            wait_healthy([node], timeout_s=120)
            _complete(node.url, prompts[0])
            _complete(node.url, prompts[0])  # a prefix hit: stored once
            for prompt in prompts[1:]:
                _complete(node.url, prompt)
            status, body = http_json(f"{node.url}/v1/kvbridge/reset_prefix_cache", {}, timeout_s=60)
            assert status == 200, body
            live = sub.received()
            replayed = sub.replay(replay_endpoint, 0)
            from_third = sub.replay(replay_endpoint, 3)
        finally:
            node.stop()

    # The replay holds every batch since start, numbered from 0, under the topic; what the SUB socket got
    # is the same bytes (it may have missed the first ones while connecting: that is what replays are for).
    assert [seq for _, seq, _ in replayed] == list(range(len(replayed))), [seq for _, seq, _ in replayed]
    assert {topic for topic, _, _ in replayed} == {b"kv@node"}
    assert from_third == replayed[3:]
    assert live, "the SUB socket received nothing"
    by_seq = {seq: payload for _, seq, payload in replayed}
    for _, seq, batch in live:
        assert decode_batch(by_seq[seq]) == batch
    assert [seq for _, seq, _ in live] == list(range(live[0][1], live[0][1] + len(live)))

    events = [event for _, _, payload in replayed for event in decode_batch(payload).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    first = stored[0]
    expected = [external_block_hash(d) for d in hasher.hash_full_blocks(prompts[0], BLOCK_SIZE)]
    assert first.parent_block_hash is None and first.block_size == BLOCK_SIZE and first.medium == "GPU"
    assert first.token_ids[: len(expected) * BLOCK_SIZE] == prompts[0][: len(expected) * BLOCK_SIZE]
    assert first.block_hashes[: len(expected)] == expected
    chains = [[external_block_hash(d) for d in hasher.hash_full_blocks(p, BLOCK_SIZE)] for p in prompts]
    for event in stored:  # every stored run is vLLM's chain of some prompt's tokens, right after its parent
        n = len(event.block_hashes)
        matches = [
            (prompt, k) for prompt, chain in zip(prompts, chains)
            for k in ([0] if event.parent_block_hash is None else [chain.index(event.parent_block_hash) + 1]
                      if event.parent_block_hash in chain else [])
            if chain[k : k + n] == event.block_hashes
        ]  # fmt: skip
        assert matches, f"a stored run that is no prompt's vLLM chain: {event}"
        prompt, k = matches[0]
        assert event.token_ids == prompt[k * BLOCK_SIZE : (k + n) * BLOCK_SIZE]
    all_stored = [h for e in stored for h in e.block_hashes]
    assert len(all_stored) == len(set(all_stored)), "a block stored twice without being removed"
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "six 100-token prompts in 24 blocks evicted nothing"
    assert set(removed) <= set(all_stored)
    assert set(expected) & set(removed), "the least recently used prompt was not evicted first"
    assert isinstance(events[-1], AllBlocksCleared)


def test_a_bad_events_config_is_refused_before_the_node_starts():
    (port,) = free_ports(1)
    bad = '{"enable_kv_cache_events": true, "publisher": "kafka"}'
    proc = subprocess.run(cli_argv("serve", "--no-connector", "--port", str(port), "--kv-events-config", bad),
                          check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "publisher 'kafka'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
