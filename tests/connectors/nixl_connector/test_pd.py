"""P/D disaggregation end to end: a prefill engine in another OS process, real NIXL over UCX on
loopback, the decode engine in this process. Every completion must equal a colocated engine's."""

from __future__ import annotations

import gc
import logging
import random
import time
import weakref

import pytest
from prefill_node import BLOCK_SIZE, PrefillNode, engine_kwargs, prefill_node

from kvbridge import LLM, SamplingParams

pytestmark = pytest.mark.nixl

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def make_prompts(seed: int) -> list[dict]:
    """Token prompts of mixed lengths: shorter than a block, exact multiples of a block, ragged."""
    rng = random.Random(seed)
    print(f"prompt seed {seed}")
    lengths = [5, BLOCK_SIZE, 3 * BLOCK_SIZE, 3 * BLOCK_SIZE + 7, 90, 150]
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in lengths]


def same_length_prompts(seed: int, num_tokens: int, count: int = 3) -> list[dict]:
    """`count` token prompts of `num_tokens` each."""
    rng = random.Random(seed)
    print(f"prompt seed {seed}")
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(num_tokens)]} for _ in range(count)]


@pytest.fixture(scope="module")
def node():
    with prefill_node(**engine_kwargs("prefill-main", "kv_producer")) as n:
        yield n


def colocated(reference: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY)]


def decode_engine(engine_id: str, **kv) -> LLM:
    return LLM(**engine_kwargs(engine_id, "kv_consumer", kv=kv))


def assert_all_free_or_cached(stats: dict) -> None:
    assert stats["num_used_blocks"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


def test_pd_matches_colocated_and_frees_everything(node: PrefillNode, reference: LLM):
    prompts = make_prompts(seed=1)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    assert [len(p["remote_block_ids"]) for p in params] == [len(p["prompt_token_ids"]) // BLOCK_SIZE for p in prompts]

    with decode_engine("decode-1") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [o.num_external_tokens for o in outs] == [len(p["remote_block_ids"]) * BLOCK_SIZE for p in params]
        worker = dec.get_stats()["connector"]["worker"]
        assert worker["num_transfers"] == sum(1 for p in params if p["remote_block_ids"])
        assert worker["bytes_transferred"] == sum(len(p["remote_block_ids"]) for p in params) * dec.engine.layout.block_nbytes
        assert worker["num_failures"] == 0 and worker["throughput_gbps"] > 0
        assert worker["confirm_ms_p50"] > 0  # every read waited for its lease's confirmation
        # every block read was digested here and matched the prefill's digest before it was used
        assert worker["num_digested_bytes"] == worker["bytes_transferred"]
        assert worker["num_digest_mismatches"] == worker["num_unverified_reads"] == 0
        read = dec.engine.worker_connector.worker.stats.last_read
        assert read.posted <= read.landed <= read.confirmed
        dec.engine.check_integrity()
        assert_all_free_or_cached(dec.get_stats())

    # the decode side released every lease: the prefill engine frees all blocks well before the lease ends
    state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
    assert_all_free_or_cached(state)
    assert state["connector"]["worker"]["num_expired_leases"] == 0


def test_decode_reads_only_blocks_missing_from_its_prefix_cache(node: PrefillNode, reference: LLM):
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(4 * BLOCK_SIZE)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 250) for _ in range(n)]} for n in (2 * BLOCK_SIZE + 3, 40)]
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    with decode_engine("decode-2") as dec:
        dec.generate([{"prompt_token_ids": shared + [1]}], GREEDY)  # warms the decode's prefix cache
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        for out, p in zip(outs, params):
            assert out.num_cached_tokens == 4 * BLOCK_SIZE
            assert out.num_external_tokens == len(p["remote_block_ids"]) * BLOCK_SIZE - 4 * BLOCK_SIZE
        dec.engine.check_integrity()
        assert_all_free_or_cached(dec.get_stats())
    assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))


def test_params_of_another_prompt_are_refused_and_released(node: PrefillNode, reference: LLM):
    prompt_a, prompt_b = make_prompts(seed=8)[3:5]
    want_b = colocated(reference, [prompt_b])
    params_a = node.prefill([prompt_a])
    with decode_engine("decode-mismatch") as dec:
        out = dec.generate([prompt_b], GREEDY, kv_transfer_params=params_a)[0]
        assert out.outputs[0].token_ids == want_b[0] and out.num_external_tokens == 0
        assert dec.get_stats()["connector"]["scheduler"]["num_mismatched_params"] == 1
    # the decode node told the prefill node it will not read: the blocks go back before the lease ends
    assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))


def test_a_bit_flipped_in_flight_is_never_served(node: PrefillNode, reference: LLM, monkeypatch, caplog):
    prompts = make_prompts(seed=9)[2:5]
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT", "1")  # one bit of each read's first block, once it landed
    with decode_engine("decode-flip") as dec:
        with caplog.at_level(logging.ERROR, logger="kvbridge"):
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_external_tokens == 0 for o in outs)  # recomputed: not one token of the read KV used
        worker = dec.get_stats()["connector"]["worker"]
        assert worker["num_digest_mismatches"] == len(prompts) and worker["num_transfers"] == len(prompts)
        assert "KV DIGEST MISMATCH" in caplog.text and "remote block" in caplog.text
        dec.engine.check_integrity()
        assert_all_free_or_cached(dec.get_stats())
    assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))


def test_reads_the_prefill_did_not_digest_are_used_only_where_verification_is_off(reference: LLM):
    prompts = make_prompts(seed=10)[3:5]
    want = colocated(reference, prompts)
    unverified = {"extra": {"verify_kv_digest": False}}
    with prefill_node(**engine_kwargs("prefill-no-digest", "kv_producer", kv=unverified)) as n:
        with decode_engine("decode-strict") as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=n.prefill(prompts))
            assert [o.outputs[0].token_ids for o in outs] == want
            assert all(o.num_external_tokens == 0 for o in outs)
            assert dec.get_stats()["connector"]["worker"]["num_unverified_reads"] == len(prompts)
        with decode_engine("decode-trusting", extra={"verify_kv_digest": False}) as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=n.prefill(prompts))
            assert [o.outputs[0].token_ids for o in outs] == want
            assert all(o.num_external_tokens > 0 for o in outs)
            assert dec.get_stats()["connector"]["worker"]["num_digested_bytes"] == 0
        n.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


def test_unread_blocks_are_freed_when_the_lease_expires_and_late_reads_are_refused(reference: LLM):
    prompts = make_prompts(seed=2)[2:4]
    want = colocated(reference, prompts)
    with prefill_node(**engine_kwargs("prefill-lease", "kv_producer", kv={"extra": {"lease_s": 1.0}})) as n:
        params = n.prefill(prompts)
        assert n.state()["num_used_blocks"] > 0
        state = n.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
        assert_all_free_or_cached(state)
        assert state["connector"]["worker"]["num_expired_leases"] == len(prompts)

        # A decode node that reads now may see reused blocks: the read is refused, the prompt recomputed.
        with decode_engine("decode-late") as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            worker = dec.get_stats()["connector"]["worker"]
            assert worker["num_expired_reads"] == len(prompts)
            assert dec.get_stats()["num_load_recomputes"] >= len(prompts)
            dec.engine.check_integrity()
            assert_all_free_or_cached(dec.get_stats())


def _params_then_kill(prompts, engine_id: str, warm: LLM | None = None) -> list[dict]:
    node = PrefillNode(**engine_kwargs(engine_id, "kv_producer"))
    try:
        if warm is not None:  # handshake first, so the dead peer is met by a posted read
            warm.generate(prompts[:1], GREEDY, kv_transfer_params=node.prefill(prompts[:1]))
        return node.prefill(prompts)
    finally:
        node.kill()


FAST_FAIL = {"handshake_timeout_s": 0.5, "handshake_retries": 1, "transfer_timeout_s": 5.0}


@pytest.mark.parametrize("warm", [False, True], ids=["before-handshake", "after-handshake"])
def test_dead_prefill_node_means_recompute_within_the_deadline(reference: LLM, warm: bool):
    prompts = make_prompts(seed=3)[2:]
    want = colocated(reference, prompts)
    with decode_engine(f"decode-dead-{warm}", extra=FAST_FAIL) as dec:
        params = _params_then_kill(prompts, f"prefill-dead-{warm}", dec if warm else None)
        start = time.monotonic()
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        elapsed = time.monotonic() - start
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.error is None for o in outs)
        assert elapsed < 30, f"recompute took {elapsed:.1f}s"
        assert dec.get_stats()["connector"]["worker"]["num_failures"] >= 1
        dec.engine.check_integrity()
        assert_all_free_or_cached(dec.get_stats())


def test_fail_policy_gives_a_clear_error(reference: LLM):
    prompts = make_prompts(seed=4)[3:5]
    with decode_engine("decode-fail", extra=FAST_FAIL, load_failure_policy="fail") as dec:
        params = _params_then_kill(prompts, "prefill-fail")
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        for out in outs:
            assert out.outputs[0].finish_reason == "error"
            assert "load_failure_policy is 'fail'" in out.error and "NixlConnector" in out.error
        assert "PeerUnreachableError" in dec.get_stats()["connector"]["worker"]["last_error"]
        dec.engine.check_integrity()
        assert_all_free_or_cached(dec.get_stats())


def test_blocks_of_another_size_are_checked_at_their_size_and_another_prompts_never_read(reference: LLM, caplog):
    """A block hash of 32-token blocks is compared with this prompt hashed in 32-token blocks (16-token
    blocks here): the params of another prompt are refused. (Matching ones are read through a read
    plan: test_pd_block_sizes.py.)"""
    prompts = make_prompts(seed=5)[4:]
    others = [{"prompt_token_ids": list(reversed(p["prompt_token_ids"]))} for p in prompts]
    want = colocated(reference, prompts)
    with prefill_node(**engine_kwargs("prefill-bs32", "kv_producer", block_size=32)) as n:
        params = n.prefill(others)
        with decode_engine("decode-bs16", load_failure_policy="fail") as dec:
            with caplog.at_level(logging.ERROR, logger="kvbridge"):
                outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert all(o.num_external_tokens == 0 for o in outs)
            assert dec.get_stats()["connector"]["scheduler"]["num_mismatched_params"] == len(prompts)
            assert "block hash mismatch" in caplog.text
            assert_all_free_or_cached(dec.get_stats())
        n.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=30)  # the decode released what it never read


def test_engine_cycles_release_every_tensor_and_deregister_first(node: PrefillNode, reference: LLM):
    from memory_snapshot import take_snapshot

    from kvbridge.transfer.agent import NixlAgent

    prompts = make_prompts(seed=6)[3:5]
    want = colocated(reference, prompts)
    alive_at_deregistration: list[bool] = []
    close = NixlAgent.close
    kv_ref: list[weakref.ref] = []

    def spy(self):
        if not self._closed:
            alive_at_deregistration.append(kv_ref[-1]() is not None)
        close(self)
        assert not self._registrations

    NixlAgent.close = spy
    try:
        baseline = None
        refs = []
        for cycle in range(10):
            dec = decode_engine(f"decode-cycle-{cycle}")
            kv_ref.append(weakref.ref(dec.engine.runner.kv_cache))
            refs += [kv_ref[-1], weakref.ref(next(dec.engine.runner.model.parameters()))]
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=node.prefill(prompts))
            assert [o.outputs[0].token_ids for o in outs] == want
            dec.shutdown()
            del dec, outs
            gc.collect()
            snap = take_snapshot()
            baseline = baseline or snap
            print(f"cycle {cycle}: rss {snap.rss_bytes / 2**20:.1f} MiB, tensors {snap.num_live_tensors}")
    finally:
        NixlAgent.close = close
    assert all(r() is None for r in refs), "an engine tensor outlived its engine"
    # each engine deregistered its KV cache while the tensor was still alive (deregister before free)
    assert alive_at_deregistration == [True] * 10
    assert snap.num_live_tensors <= baseline.num_live_tensors
    assert snap.rss_bytes - baseline.rss_bytes < 64 * 2**20, "RSS grew across engine cycles"
