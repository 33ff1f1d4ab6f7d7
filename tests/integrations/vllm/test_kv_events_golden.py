"""kvbridge's KV events are vLLM's: a real `kvbridge serve --kv-events-config` publishes, and vLLM's own
msgspec classes (vllm/distributed/kv_events.py) decode every frame, re-encode it to the very same bytes,
and find in it the block hashes vLLM's own functions (vllm/v1/core/kv_cache_utils.py) compute for the
same tokens, for each hash algorithm, seed and hash form a fleet may set."""

from __future__ import annotations

import json
import random
import tempfile

import msgspec
import pytest
import zmq

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from kvbridge.serve.launcher import HOST, free_ports, http_json, start_node, wait_healthy  # noqa: E402
from kvbridge.transfer.kv_event_publisher import END_SEQ  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16


def _vllm_chain(algo: str, tokens: list[int]) -> list:
    """vLLM's external hashes of every full block of `tokens`, computed by vLLM's functions."""
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)  # reads PYTHONHASHSEED, as a vLLM engine does at start
    parent, out = None, []
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + BLOCK_SIZE])
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))  # reads VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    return out


def _replay(endpoint: str) -> list[bytes]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 30_000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        payloads = []
        while True:
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return payloads
            payloads.append(payload)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(
    ("algo", "env"),
    [
        ("sha256", {}),  # vLLM's defaults: pickle + SHA-256, the fixed seed, 64-bit int hashes
        ("sha256_cbor", {"PYTHONHASHSEED": "1234"}),  # a fleet-wide seed
        ("sha256", {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}),  # digests as bytes
        ("xxhash", {"PYTHONHASHSEED": "7"}),
    ],
)
def test_vllm_decodes_kvbridge_events_and_finds_its_own_hashes(algo, env, monkeypatch):
    for name in ("PYTHONHASHSEED", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 384) for _ in range(rng.randrange(100, 128))] for _ in range(3)]
    prompts.append(prompts[0][:48] + [rng.randrange(1, 384) for _ in range(40)])  # shares 3 blocks with the first
    replay = f"tcp://{HOST}:{free_ports(1)[0]}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tempfile.mkdtemp()}/pub",
              "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
    with tempfile.TemporaryDirectory() as log_dir:
        args = ["--no-connector", "--num-threads", "1", "--num-blocks", "16", "--max-model-len", "256",
                "--kv-events-config", json.dumps(config), "--prefix-caching-hash-algo", algo]  # fmt: skip
        node = start_node("events", "both", log_dir, extra_args=args, env=env)
        try:
            wait_healthy([node], timeout_s=120)
            for prompt in prompts:
                status, body = http_json(f"{node.url}/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout_s=60)
                assert status == 200, body
            status, body = http_json(f"{node.url}/v1/kvbridge/reset_prefix_cache", {}, timeout_s=60)
            assert status == 200, body
            payloads = _replay(replay)
        finally:
            node.stop()

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [decoder.decode(p) for p in payloads]
    for payload, batch in zip(payloads, batches):  # vLLM's classes hold every field we sent: nothing dropped
        assert msgspec.msgpack.encode(batch) == payload
        assert batch.data_parallel_rank == 0
    events = [e for b in batches for e in b.events]
    assert isinstance(events[-1], AllBlocksCleared)
    chains = [_vllm_chain(algo, p) for p in prompts]
    stored = [e for e in events if isinstance(e, BlockStored)]
    published = {h for e in stored for h in e.block_hashes}
    assert chains[0] and set(chains[0]) <= published
    assert set(chains[3]) <= published  # its shared prefix stored by the first prompt (or again, once evicted)
    assert stored[-1].block_hashes[-1] == chains[3][-1]
    for event in stored:  # each stored run is a slice of a prompt's vLLM chain, chained after its parent
        n = len(event.block_hashes)
        slices = [(c, c.index(event.block_hashes[0])) for c in chains if event.block_hashes[0] in c]
        assert any(c[k : k + n] == event.block_hashes and event.parent_block_hash == (c[k - 1] if k else None)
                   for c, k in slices), event  # fmt: skip
        assert event.block_size == BLOCK_SIZE and event.medium == "GPU" and event.lora_name is None
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed, "four prompts of 23 blocks or more in 16 evicted nothing"
    assert removed <= published
