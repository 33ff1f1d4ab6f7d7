"""The bytes of a read, not only its lease: a decode node never serves KV whose bytes differ from
what the prefill digested when it granted the lease.

Two ways the bytes go wrong while every lease check passes: a third party that reached the
prefill's side channel writes into its leased blocks through NIXL after the lease was granted (the
handshake hands out the agent metadata of the whole KV region, and registrations allow writes),
and a bit flips in flight (the decode node's fault hook). Each time the decode node must recompute
the prompt (the right tokens, no remote KV used) and count the mismatch on /metrics.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from chaos_harness import (
    MAX_MODEL_LEN,
    NodeSet,
    assert_clean,
    assert_correct,
    complete,
    external_tokens,
    metric,
    prefill,
    prompt,
    references,
    wait_granted,
)
from chaos_sockets import side_channel_address

from kvbridge import LLM
from kvbridge.transfer.agent import XferState
from kvbridge.transfer.descriptors import range_descs
from kvbridge.transfer.endpoint import KVEndpoint
from kvbridge.transfer.options import TransferOp

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

WRITTEN, FLIPPED = prompt("integrity-written", 180), prompt("integrity-flipped", 180)


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("decode", "decode")
        nodes.start("flipping-decode", "decode", env={"KVBRIDGE_FAULT_FLIP_READ_BIT": "1"})
        nodes.refs = references([WRITTEN, FLIPPED])
        nodes.wait()
        yield nodes


MISMATCHES = "kvbridge_engine_connector_worker_num_digest_mismatches"


def _overwrite_through_nixl(params: dict) -> None:
    """A third party on the side channel: handshake, then a NIXL WRITE of zeros over the leased blocks."""
    with LLM(max_model_len=MAX_MODEL_LEN, num_blocks=4) as llm:  # the same model: its compat hash
        model_id, layout = llm.engine.model_id, llm.engine.layout
    kv = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    attacker = KVEndpoint("attacker", model_id, kv, layout, serve=False, secret=None)
    try:
        peer = attacker.handshake(side_channel_address(params))
        ids = np.asarray(params["remote_block_ids"], dtype=np.int64)
        agent, r = attacker.agent, peer.region
        nbytes = np.full(len(ids), layout.block_nbytes, dtype=np.int64)
        zeros = agent.register_tensor(torch.zeros(len(ids) * layout.block_nbytes, dtype=torch.uint8))
        local = agent.prep_local(range_descs(np.arange(len(ids)) * layout.block_nbytes, nbytes, zeros.base_addr,
                                             zeros.device_id), zeros.mem_type)  # fmt: skip
        remote = agent.prep_remote(peer.agent_name, range_descs(peer.layout.block_offsets(ids), nbytes, r.base_addr,
                                                                r.device_id), r.mem_type)  # fmt: skip
        idx = np.arange(len(ids))
        handle = agent.post(TransferOp.WRITE, local, idx, remote, idx)
        deadline = time.monotonic() + 30
        while (state := agent.poll(handle)) is XferState.IN_PROGRESS:
            assert time.monotonic() < deadline, "the attacker's WRITE never finished"
            time.sleep(0.01)
        assert state is XferState.DONE, "the prefill's KV region refused the WRITE (then this attack is moot)"
    finally:
        attacker.close()


def test_blocks_written_after_the_lease_was_granted_are_never_served(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    before = metric(d, MISMATCHES)
    params = prefill(p, WRITTEN)
    wait_granted(params)
    _overwrite_through_nixl(params)
    status, body = complete(d, WRITTEN, params)
    assert_correct(status, body, cluster.refs[WRITTEN], allow_error=False)
    assert external_tokens(body) == 0, "KV that does not match the prefill's digest was used"
    assert metric(d, MISMATCHES) == before + 1
    assert_clean(p, d)


def test_a_bit_flipped_in_flight_is_never_served(cluster):
    p, d = cluster.url("prefill"), cluster.url("flipping-decode")
    before = metric(d, MISMATCHES)
    status, body = complete(d, FLIPPED, prefill(p, FLIPPED))
    assert_correct(status, body, cluster.refs[FLIPPED], allow_error=False)
    assert external_tokens(body) == 0, "KV with a flipped bit was used"
    assert metric(d, MISMATCHES) == before + 1
    # the same prompt and node, without the fault, pull the KV: the check refuses only what differs
    status, body = complete(cluster.url("decode"), FLIPPED, prefill(p, FLIPPED))
    assert_correct(status, body, cluster.refs[FLIPPED], allow_error=False)
    assert external_tokens(body) > 0
    assert_clean(p, d, cluster.url("decode"))
