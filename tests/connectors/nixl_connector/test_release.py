"""`release_remote_kv`: a proxy frees a prefill's held blocks when the decode leg fails, and only the
holder of the params can. A real prefill engine in another process, NIXL's side channel on loopback."""

from __future__ import annotations

import threading
import time

import pytest
from prefill_node import BLOCK_SIZE, engine_kwargs, prefill_node

from kvbridge.transfer.host_secret import side_channel_secret
from kvbridge.transfer.lease_release import release_remote_kv

pytestmark = pytest.mark.nixl

SECRET = side_channel_secret()  # what the node signs with when none is configured, as a proxy of this user does

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
            assert release_remote_kv(params, secret=SECRET, timeout_s=2.0) is False
        assert node.state()["num_used_blocks"] == held  # nothing was freed

        assert release_remote_kv(victim, secret=SECRET, timeout_s=2.0) is True
        assert 0 < node.wait_until(lambda s: s["num_used_blocks"] < held, timeout_s=10)["num_used_blocks"] < held
        assert release_remote_kv(victim, secret=SECRET, timeout_s=2.0) is False  # released once, never again
        assert release_remote_kv(other, secret=SECRET, timeout_s=2.0) is True
        node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)


def test_a_release_that_comes_before_the_grant_frees_the_blocks_at_the_grant():
    """The proxy can hear the prefill's answer before the prefill engine's next step grants the lease,
    and its decode leg can fail at once (a decode node that refuses the request): its release then
    arrives before the lease exists and is answered "pending". The prefill remembers it and ends the
    lease at the grant, whether the releaser gave up meanwhile or still asks: the blocks never wait
    out the 60 s term. (A prefill that signs grants grants as the request finishes, before it answers:
    this is the path of one that grants in its next step, as a tensor-parallel prefill does.)"""
    kv = {"extra": {"lease_s": 60, "sign_grants": False}}
    with prefill_node(**engine_kwargs("prefill-early-release", "kv_producer", kv=kv)) as node:
        (gave_up,) = node.prefill(PROMPTS[:1], pause=True)  # answered; the lease is not granted yet
        assert node.state()["num_used_blocks"] >= len(gave_up["remote_block_ids"])
        assert release_remote_kv(gave_up, secret=SECRET, timeout_s=0.3) is False  # "pending" to the end
        node.resume()
        freed = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
        assert freed["num_used_blocks"] == 0, "the blocks wait for the lease to expire: the early release was lost"

        (asks_again,) = node.prefill(PROMPTS[1:], pause=True)
        result = []
        releaser = threading.Thread(target=lambda: result.append(release_remote_kv(asks_again, secret=SECRET, timeout_s=30)))
        releaser.start()
        time.sleep(0.3)  # it hears "pending" meanwhile
        assert releaser.is_alive() and node.state()["num_used_blocks"] > 0
        node.resume()
        releaser.join(timeout=30)
        assert result == [True]  # its retry after the grant hears "released"
        stats = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
        assert stats["num_used_blocks"] == 0, stats
        worker = stats["connector"]["worker"]
        assert worker["num_leases_abandoned_before_grant"] == 2 and worker["num_expired_leases"] == 0, worker


def test_an_unreachable_prefill_is_reported_not_raised():
    with prefill_node(**engine_kwargs("prefill-gone", "kv_producer")) as node:
        (params,) = node.prefill(PROMPTS[:1])
        node.kill()  # dies holding the lease
    assert release_remote_kv(params, secret=SECRET, timeout_s=0.5) is False  # the node has stopped
