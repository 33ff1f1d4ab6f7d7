"""A defect in a prefill's lease digests costs those leases' verified reads, never the prefill node: attacked
end to end with a prefill engine in another OS process whose digests raise (KVBRIDGE_FAULT_DIGEST_DEFECT),
real NIXL over UCX on loopback, and a verifying decode engine in this process.

On an H100 such a defect (per-head digests of KV held one tensor per layer) raised out of the grant, through
vLLM's step, and vLLM's engine died. Now the lease is granted without a digest: a decode that verifies
refuses its blocks and computes the prompt itself, and the prefill node keeps serving and frees them.
"""

from __future__ import annotations

import pytest
from prefill_node import BLOCK_SIZE, engine_kwargs, prefill_node
from test_pd import GREEDY, colocated, decode_engine, same_length_prompts

pytestmark = pytest.mark.nixl


def prompts_of(seed: int) -> list[dict]:
    return same_length_prompts(seed, 3 * BLOCK_SIZE + 5, count=2)


def test_a_prefill_whose_digests_raise_keeps_serving_and_readers_compute(reference, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_FAULT_DIGEST_DEFECT", "1")  # the prefill process inherits it at spawn
    with prefill_node(**engine_kwargs("prefill-digest-defect", "kv_producer")) as node:
        monkeypatch.delenv("KVBRIDGE_FAULT_DIGEST_DEFECT")  # the decode here digests as it should
        first, second = prompts_of(seed=51), prompts_of(seed=52)
        params = node.prefill(first)
        with decode_engine("decode-digest-defect") as dec:
            outs = dec.generate(first, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == colocated(reference, first)
            assert [o.num_external_tokens for o in outs] == [0, 0], "blocks without a digest were used"
            # the node lived through both grants: it prefills again, and frees every leased block
            more = node.prefill(second)
            assert [len(p["remote_block_ids"]) for p in more] == [3, 3]
            outs = dec.generate(second, GREEDY, kv_transfer_params=more)
            assert [o.outputs[0].token_ids for o in outs] == colocated(reference, second)
        state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=40)
        assert state["num_used_blocks"] == 0, state
        assert node.process.is_alive()
