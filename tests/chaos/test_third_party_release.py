"""A third party tries to release a victim's live lease, so that the prefill reuses its blocks
before the victim reads them.

Over the side channel of a node without a secret (a `TransferDone` naming the victim's request
id, with no token or a made-up one, in the current and the old message format), and through a
decode node's HTTP API on nodes with a secret (a decode request with made-up blocks that names
the victim's request id). The victim's read afterwards must return its own tokens, pulled from
the prefill: the lease was never released.
"""

from __future__ import annotations

import pytest
from chaos_harness import (
    NUM_BLOCKS,
    NodeSet,
    assert_clean,
    assert_correct,
    assert_no_remote_kv,
    churn,
    complete,
    external_tokens,
    prefill,
    prompt,
    references,
)
from chaos_sockets import side_channel_address, side_channel_message

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SIDE_VICTIM = prompt("side-channel-victim", 180)
HTTP_VICTIM, HTTP_ATTACKER = prompt("http-victim", 180), prompt("http-attacker", 120)
MADE_UP_TOKEN = "00" * 16
SECRET = "chaos-suite-side-channel-secret-of-32-bytes"


@pytest.fixture(scope="module")
def open_cluster():
    """Prefill and decode without a side-channel secret."""
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("decode", "decode")
        nodes.refs = references([SIDE_VICTIM])
        nodes.wait()
        yield nodes


@pytest.fixture(scope="module")
def secret_cluster():
    """Prefill and decode that share KVBRIDGE_SIDE_CHANNEL_SECRET."""
    env = {"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET}
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill", env=env)
        nodes.start("decode", "decode", env=env)
        nodes.refs = references([HTTP_VICTIM, HTTP_ATTACKER])
        nodes.wait()
        yield nodes


def _release_attempts(victim: dict) -> list[dict]:
    """TransferDone messages naming the victim's lease by everything an attacker may know but its token."""
    lease = {
        "req_id": victim["remote_request_id"],
        "block_ids": victim["remote_block_ids"],
        "block_hash": victim["remote_block_hash"],
    }
    incarnation = victim.get("remote_incarnation", "")
    return [
        {"type": "done", "engine_id": "attacker", "req_ids": [lease["req_id"]]},  # protocol 1
        {"type": "done2", "engine_id": "attacker", "incarnation": incarnation, "leases": [{**lease, "token": ""}]},
        {"type": "done2", "engine_id": "attacker", "incarnation": incarnation,
         "leases": [{**lease, "token": MADE_UP_TOKEN}]},  # fmt: skip
        {"type": "done2", "engine_id": "attacker", "incarnation": incarnation, "leases": [],
         "failed_leases": [{**lease, "token": MADE_UP_TOKEN}]},  # fmt: skip
    ]


def test_transfer_done_from_a_third_party_does_not_release(open_cluster):
    p, d = open_cluster.url("prefill"), open_cluster.url("decode")
    victim = prefill(p, SIDE_VICTIM)
    for attempt in _release_attempts(victim):
        reply = side_channel_message(side_channel_address(victim), attempt)
        print("attacker sent", attempt, "got", reply)
        assert reply is not None, "the prefill's side channel did not answer"
        assert victim["remote_request_id"] not in reply.get("released", []), f"a third party released the lease: {reply}"
    churn(p, "side-channel", NUM_BLOCKS)  # a released lease's blocks would be reused now

    status, body = complete(d, SIDE_VICTIM, victim)
    print("victim:", status, body)
    assert_correct(status, body, open_cluster.refs[SIDE_VICTIM], allow_error=False)
    assert external_tokens(body) > 0, "the victim's lease was lost: its prompt was recomputed"
    assert_clean(p, d)


def test_decode_request_naming_a_victims_lease_does_not_release_it(secret_cluster):
    p, d = secret_cluster.url("prefill"), secret_cluster.url("decode")
    victim = prefill(p, HTTP_VICTIM)
    own = prefill(p, HTTP_ATTACKER)  # a valid block hash and incarnation for the attacker's prompt
    made_up_blocks = [NUM_BLOCKS - 1 - i for i in range(len(own["remote_block_ids"]))]
    attack = {
        **own,
        "remote_request_id": victim["remote_request_id"],
        "remote_lease_token": MADE_UP_TOKEN,
        "remote_block_ids": made_up_blocks,
    }
    status, body = complete(d, HTTP_ATTACKER, attack)
    print("attacker:", status, body)
    assert_correct(status, body, secret_cluster.refs[HTTP_ATTACKER])
    assert_no_remote_kv(status, body)
    churn(p, "http", NUM_BLOCKS)  # a released lease's blocks would be reused now

    status, body = complete(d, HTTP_VICTIM, victim)
    print("victim:", status, body)
    assert_correct(status, body, secret_cluster.refs[HTTP_VICTIM], allow_error=False)
    assert external_tokens(body) > 0, "the victim's lease was lost: its prompt was recomputed"
    status, body = complete(d, HTTP_ATTACKER, own)  # the attacker's honest read releases its own lease
    assert_correct(status, body, secret_cluster.refs[HTTP_ATTACKER], allow_error=False)
    assert_clean(p, d)
