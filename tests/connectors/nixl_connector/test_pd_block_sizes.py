"""P/D between engines of different block sizes (16 <-> 32): the decode reads through a read plan
(transfer/layout_plan.py) over real NIXL on loopback, and every completion equals a colocated engine's."""

from __future__ import annotations

import math
import random

import pytest
from prefill_node import engine_kwargs, prefill_node
from test_pd import GREEDY, assert_all_free_or_cached, colocated, make_prompts

from kvbridge import LLM

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("prefill_bs,decode_bs", [(16, 32), (32, 16)])
def test_pd_between_block_sizes_matches_colocated(prefill_bs, decode_bs):
    prompts = make_prompts(seed=3)
    reference = LLM(num_blocks=96, block_size=decode_bs)
    try:
        want = colocated(reference, prompts)
    finally:
        reference.shutdown()
    with prefill_node(**engine_kwargs(f"prefill-bs{prefill_bs}", "kv_producer", block_size=prefill_bs)) as node:
        params = node.prefill(prompts)
        step = math.lcm(prefill_bs, decode_bs)
        usable = [len(p["remote_block_ids"]) * prefill_bs // step * step for p in params]
        with LLM(**engine_kwargs(f"decode-bs{decode_bs}", "kv_consumer", block_size=decode_bs)) as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert [o.num_external_tokens for o in outs] == usable
            worker = dec.get_stats()["connector"]["worker"]
            print(worker)
            assert worker["num_staged_plan_reads"] == sum(1 for n in usable if n) and worker["num_direct_plan_reads"] == 0
            assert worker["num_failures"] == worker["num_digest_mismatches"] == worker["num_unverified_reads"] == 0
            assert worker["num_digested_bytes"] > 0  # every read was checked against the prefill's digests
            dec.engine.check_integrity()
            assert_all_free_or_cached(dec.get_stats())
        assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))


def test_a_prefix_hit_inside_a_larger_prefill_block_computes_the_rest_locally_and_releases_the_lease():
    rng = random.Random(11)
    prompt = {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(80)]}
    reference = LLM(num_blocks=96, block_size=16)
    try:
        want = colocated(reference, [prompt])
    finally:
        reference.shutdown()
    with prefill_node(**engine_kwargs("prefill-bs32-hit", "kv_producer", block_size=32)) as node:
        params = node.prefill([prompt])
        with LLM(**engine_kwargs("decode-bs16-hit", "kv_consumer", block_size=16)) as dec:
            dec.generate([{"prompt_token_ids": prompt["prompt_token_ids"][:16] + [1]}], GREEDY)  # caches one 16-token block
            out = dec.generate([prompt], GREEDY, kv_transfer_params=params)[0]
            assert out.outputs[0].token_ids == want[0]
            assert out.num_cached_tokens == 16 and out.num_external_tokens == 0
            dec.engine.check_integrity()
            assert_all_free_or_cached(dec.get_stats())
        assert_all_free_or_cached(node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10))
