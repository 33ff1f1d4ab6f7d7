"""`release_remote_kv`: a proxy frees a prefill's held blocks when the decode leg fails, and only the
holder of the params can. A real prefill engine in another process, NIXL's side channel on loopback."""

from __future__ import annotations

import pytest
from prefill_node import BLOCK_SIZE, engine_kwargs, prefill_node

from kvbridge.transfer.lease_release import release_remote_kv

pytestmark = pytest.mark.nixl

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + 3 * BLOCK_SIZE + 5))}, {"prompt_token_ids": list(range(9, 9 + 40))}]


def test_only_the_params_holder_releases_a_lease_and_only_once():
    with prefill_node(**engine_kwargs("prefill-release", "kv_producer", kv={"extra": {"lease_s": 20}})) as node:
        victim, other = node.prefill(PROMPTS)
        held = node.state()["num_used_blocks"]
        assert held >= len(victim["remote_block_ids"]) + len(other["remote_block_ids"])

        # Forgeries: a guessed token, other blocks, another incarnation, the id alone.
        forged = [
            {**victim, "remote_lease_token": "0" * 64},
            {**victim, "remote_block_ids": other["remote_block_ids"]},
            {**victim, "remote_incarnation": "f" * 32},
            {**victim, "remote_lease_token": other["remote_lease_token"]},
        ]
        for params in forged:
            assert release_remote_kv(params, secret=None, timeout_s=2.0) is False
        assert node.state()["num_used_blocks"] == held  # nothing was freed

        assert release_remote_kv(victim, secret=None, timeout_s=2.0) is True
        assert 0 < node.wait_until(lambda s: s["num_used_blocks"] < held, timeout_s=10)["num_used_blocks"] < held
        assert release_remote_kv(victim, secret=None, timeout_s=2.0) is False  # released once, never again
        assert release_remote_kv(other, secret=None, timeout_s=2.0) is True
        node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


def test_an_unreachable_prefill_is_reported_not_raised():
    with prefill_node(**engine_kwargs("prefill-gone", "kv_producer")) as node:
        (params,) = node.prefill(PROMPTS[:1])
        node.kill()  # dies holding the lease
    assert release_remote_kv(params, secret=None, timeout_s=0.5) is False  # the node has stopped
