"""MultiConnector with P/D and offload together, both directions: the prefill node keeps blocks for
the decode node (NixlConnector) while storing them to its host tier (OffloadingConnector); the decode
node pulls over NIXL, stores what it pulled, and later serves the same prompts from its host tier."""

from __future__ import annotations

import random

import pytest
from prefill_node import BLOCK_SIZE, prefill_node

from kvbridge import LLM, SamplingParams

pytestmark = pytest.mark.nixl

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def multi_kwargs(engine_id: str, role: str) -> dict:
    connectors = [
        {"connector": "NixlConnector"},
        {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 64}},
    ]
    kv = dict(connector="MultiConnector", role=role, engine_id=engine_id, extra={"connectors": connectors})
    return dict(num_blocks=48, block_size=BLOCK_SIZE, kv_transfer_config=kv)


def test_pd_plus_offload_on_both_nodes():
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in (3 * BLOCK_SIZE + 5, 5 * BLOCK_SIZE)]
    with LLM(num_blocks=96, block_size=BLOCK_SIZE) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]

    with prefill_node(**multi_kwargs("multi-prefill", "kv_producer")) as node:
        params = node.prefill(prompts)
        with LLM(**multi_kwargs("multi-decode", "kv_consumer")) as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert [o.num_external_tokens for o in outs] == [len(p["remote_block_ids"]) * BLOCK_SIZE for p in params]
            stats = dec.get_stats()["connector"]["worker"]
            assert stats["0:NixlConnector"]["num_transfers"] == len(prompts)

            # The GPU prefix cache forgets; the host tier has what NIXL brought (and what decode computed).
            assert dec.reset_prefix_cache()
            computed_before = dec.get_stats()["num_computed_tokens"]
            again = dec.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in again] == want
            # every full block comes from host, the one holding the last prompt token too (that token is
            # computed again, as after a P/D read of a whole prompt)
            for out, prompt in zip(again, prompts):
                assert out.num_external_tokens == len(prompt["prompt_token_ids"]) // BLOCK_SIZE * BLOCK_SIZE
            computed = dec.get_stats()["num_computed_tokens"] - computed_before
            assert computed < sum(len(p["prompt_token_ids"]) for p in prompts) // 2, computed
            assert dec.get_stats()["connector"]["worker"]["1:OffloadingConnector"]["bytes_loaded"] > 0
            dec.engine.check_integrity()
            assert dec.reset_prefix_cache()  # waits for the last stores; then nothing holds a block
            assert dec.get_stats()["num_used_blocks"] == 0

        # The prefill frees its blocks only when both children are done: the lease released and the stores landed.
        state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
        assert state["num_used_blocks"] == 0
        worker = state["connector"]["worker"]
        assert worker["0:NixlConnector"]["num_expired_leases"] == 0
        assert worker["1:OffloadingConnector"]["bytes_stored"] > 0
