"""P/D with the decode's first step computed while the read's confirmation travels (engine/
unconfirmed_loads.py), end to end: a prefill engine in another OS process, real NIXL over UCX on
loopback. The early step's token must reach the client only after the prefill confirmed the read and
its digests matched; a refused, corrupted or never confirmed read drops it and recomputes."""

from __future__ import annotations

import random
import time

import pytest
import torch
from prefill_node import BLOCK_SIZE, PrefillNode, engine_kwargs, prefill_node
from test_pd import GREEDY, colocated, decode_engine

from kvbridge import LLM
from kvbridge.engine.unconfirmed_loads import UnconfirmedLoads
from kvbridge.transfer.endpoint import KVEndpoint

pytestmark = pytest.mark.nixl

FAST_FAIL = {"handshake_timeout_s": 0.5, "handshake_retries": 0, "transfer_timeout_s": 5.0}


def make_prompts(seed: int, lengths=(3 * BLOCK_SIZE, 3 * BLOCK_SIZE + 7, 90)) -> list[dict]:
    rng = random.Random(seed)
    print(f"prompt seed {seed}")
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="module")
def node():
    # a prefill that grants in its next step, unsigned: every read is confirmed on the side channel,
    # the case early steps exist for (with signed grants a read is verified as it lands)
    kv = {"extra": {"sign_grants": False}}
    with prefill_node(**engine_kwargs("prefill-early", "kv_producer", kv=kv)) as n:
        yield n


def assert_all_free(dec: LLM) -> None:
    dec.engine.check_integrity()
    stats = dec.get_stats()
    assert stats["num_used_blocks"] == 0 and stats["num_unconfirmed_loads"] == 0, stats
    assert stats["connector"]["worker"]["num_recvs_in_flight"] == 0


@pytest.fixture
def held(monkeypatch) -> list[int]:
    """Every token an early step sampled (held back), in order: a spy on UnconfirmedLoads.hold."""
    tokens: list[int] = []
    hold = UnconfirmedLoads.hold

    def spy(self, request_id, token):
        tokens.append(token.token_id)
        hold(self, request_id, token)

    monkeypatch.setattr(UnconfirmedLoads, "hold", spy)
    return tokens


def drive(dec: LLM, prompt: dict, params: dict, on_step=lambda engine: None, timeout_s: float = 60):
    """Run one request step by step; returns (its final output, [(time, output) for every output])."""
    engine = dec.engine
    req_id = f"r{time.monotonic_ns()}"
    engine.add_request(req_id, prompt["prompt_token_ids"], GREEDY, params)
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == req_id:
                seen.append((time.monotonic(), out))
                if out.finished:
                    return out, seen
        on_step(engine)
        if engine.is_idle:
            engine.wait_for_work(0.002)
    raise AssertionError(f"request not finished within {timeout_s}s")


def test_early_steps_give_the_colocated_tokens(node: PrefillNode, reference: LLM, held: list[int]):
    prompts = make_prompts(seed=21)
    want = colocated(reference, prompts)
    with decode_engine("decode-early") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=node.prefill(prompts))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_external_tokens > 0 for o in outs)  # the read KV was used
        stats = dec.get_stats()
        assert stats["num_early_steps"] == stats["num_early_steps_used"] == len(prompts)
        assert stats["num_early_steps_discarded"] == 0
        assert sorted(held) == sorted(w[0] for w in want)  # the held tokens were the first tokens
        assert_all_free(dec)
    state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
    assert state["num_used_blocks"] == 0 and state["connector"]["worker"]["num_leases"] == 0


def test_the_early_token_comes_only_after_the_confirmation(node: PrefillNode, reference: LLM, monkeypatch):
    prompt = make_prompts(seed=22)[1]
    want = colocated(reference, [prompt])[0]
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "0.5")  # the confirmation leaves 0.5 s after landing
    with decode_engine("decode-delayed") as dec:
        early_at = []

        def watch(engine):
            if not early_at and engine.get_stats()["num_early_steps"]:
                early_at.append(time.monotonic())

        out, seen = drive(dec, prompt, node.prefill([prompt])[0], watch)
        read = dec.engine.worker_connector.worker.stats.last_read
        assert out.outputs[0].token_ids == want and out.num_external_tokens > 0
        assert early_at and early_at[0] < read.landed + 0.4  # the early step ran while the confirmation waited
        assert read.confirmed - read.landed >= 0.5
        assert seen[0][0] >= read.confirmed  # and nothing came out before the read was confirmed
        assert dec.get_stats()["num_early_steps_used"] == 1
        assert_all_free(dec)


def scramble_landed_blocks(monkeypatch) -> None:
    """KVBRIDGE_FAULT_FLIP_READ_BIT, made loud: the first block of every landed read is overwritten
    with noise, so a token computed on it differs from the right one (the test could see one leak)."""

    def scramble(self, block_id):
        offset = self.layout.block_offset(block_id)
        block = self._region_bytes[offset : offset + self.layout.block_nbytes].view(torch.float32)  # [block floats]
        block.copy_(torch.randn(block.shape, generator=torch.Generator().manual_seed(block_id)) * 4)

    monkeypatch.setattr(KVEndpoint, "flip_bit", scramble)
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT", "1")


def test_corrupted_bytes_never_reach_an_answer(node: PrefillNode, reference: LLM, monkeypatch, held: list[int]):
    prompts = make_prompts(seed=23)
    want = colocated(reference, prompts)
    scramble_landed_blocks(monkeypatch)
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "0.2")  # every early step samples before the verdict
    with decode_engine("decode-scrambled") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=node.prefill(prompts))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_external_tokens == 0 for o in outs)  # recomputed
        stats = dec.get_stats()
        assert stats["connector"]["worker"]["num_digest_mismatches"] == len(prompts)
        assert stats["num_early_steps"] == stats["num_early_steps_discarded"] == len(prompts)
        assert stats["num_early_steps_used"] == 0
        assert_all_free(dec)
    # the early steps sampled on the noise, and not every token they held was right: none was served
    assert len(held) == len(prompts) and sorted(held) != sorted(w[0] for w in want)
    state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
    assert state["num_used_blocks"] == 0 and state["connector"]["worker"]["num_leases"] == 0


def test_a_refused_confirmation_drops_the_early_token(reference: LLM, monkeypatch, held: list[int]):
    prompts = make_prompts(seed=24)[:2]
    want = colocated(reference, prompts)
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "0.2")  # the early step's token is held, then refused
    with prefill_node(**engine_kwargs("prefill-early-lease", "kv_producer", kv={"extra": {"lease_s": 1.0}})) as n:
        params = n.prefill(prompts)
        n.wait_until(lambda s: s["connector"]["worker"]["num_expired_leases"] == len(prompts), timeout_s=10)
        with decode_engine("decode-refused") as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert all(o.num_external_tokens == 0 for o in outs)
            stats = dec.get_stats()
            assert stats["connector"]["worker"]["num_expired_reads"] == len(prompts)
            assert len(held) == stats["num_early_steps_discarded"] == len(prompts)
            assert stats["num_early_steps_used"] == 0
            assert_all_free(dec)
        state = n.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
        assert state["num_used_blocks"] == 0 and state["connector"]["worker"]["num_leases"] == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_killed_before_it_confirms_means_no_early_token(reference: LLM, monkeypatch, held: list[int], policy):
    prompt = make_prompts(seed=25)[1]
    want = colocated(reference, [prompt])[0]
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "1.0")
    node = PrefillNode(**engine_kwargs(f"prefill-killed-{policy}", "kv_producer", kv={"extra": {"sign_grants": False}}))
    try:
        params = node.prefill([prompt])[0]
        with decode_engine(f"decode-orphan-{policy}", extra=FAST_FAIL, load_failure_policy=policy) as dec:

            killed_at = []

            def kill_once_held(engine):
                if held and not killed_at:
                    node.kill()  # SIGKILL: the read landed, its token is held, the confirmation never comes
                    killed_at.append(time.monotonic())

            out, seen = drive(dec, prompt, params, kill_once_held)
            assert killed_at and not node.process.is_alive() and len(held) == 1
            assert seen[0][0] > killed_at[0]  # nothing came out while the token was held
            assert all(o.outputs[0].token_ids == want[: len(o.outputs[0].token_ids)] for _, o in seen)
            if policy == "recompute":
                assert out.outputs[0].token_ids == want and out.error is None and out.num_external_tokens == 0
            else:
                assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "error" and "KV" in out.error
            stats = dec.get_stats()
            assert stats["num_early_steps_discarded"] == 1 and stats["num_early_steps_used"] == 0
            assert stats["connector"]["worker"]["num_expired_reads"] == 1
            assert_all_free(dec)
    finally:
        node.kill()
