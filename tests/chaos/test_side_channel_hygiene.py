"""What an unauthenticated caller of a side channel learns and reaches: nothing about which request
ids are live, and, with a secret set, not the payload decoder (the MAC is checked first).

Raw frames on plain ZMQ sockets, against real node processes on loopback.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest
from chaos_harness import NodeSet, assert_clean, complete, prefill, prompt, references, wait_granted
from chaos_sockets import side_channel_address, side_channel_message, side_channel_send

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

VICTIM = prompt("hygiene-victim", 180)
SECRET = "hygiene-suite-side-channel-secret"


@pytest.fixture(scope="module")
def open_cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("decode", "decode")
        nodes.refs = references([VICTIM])
        nodes.wait()
        yield nodes


@pytest.fixture(scope="module")
def secret_prefill():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill", env={"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET})
        nodes.wait()
        yield nodes


def _lease(params: dict, **changes) -> dict:
    lease = {
        "req_id": params["remote_request_id"],
        "token": params["remote_lease_token"],
        "block_ids": params["remote_block_ids"],
        "block_hash": params["remote_block_hash"],
    }
    return lease | changes


def test_a_live_request_id_is_answered_like_one_never_granted(open_cluster):
    p, d = open_cluster.url("prefill"), open_cluster.url("decode")
    victim = prefill(p, VICTIM)
    address, incarnation = side_channel_address(victim), victim["remote_incarnation"]
    made_up = _lease(victim, req_id="never-granted-" + os.urandom(8).hex(), token="00" * 32)
    wrong_token = _lease(victim, token="00" * 32)
    wait_granted(victim)  # the probes meet a live, granted lease
    answers = {}
    for name, lease in (("made_up", made_up), ("live", wrong_token)):
        for kind, key in (("lease2", "leases"), ("done2", "failed_leases")):
            msg = {"type": kind, "engine_id": "prober", "incarnation": incarnation, key: [lease]}
            reply = side_channel_message(address, msg)
            assert reply is not None, "no answer"
            answers[name, kind] = sorted((k, v) for k, v in reply.items() if isinstance(v, list) and v)
    for kind in ("lease2", "done2"):
        made_up_answer = [(k, ["<id>"]) for k, _ in answers["made_up", kind]]
        live_answer = [(k, ["<id>"]) for k, _ in answers["live", kind]]
        assert live_answer == made_up_answer, f"{kind}: a live id is told apart from a made-up one: {answers}"
    # the probes changed nothing: the victim still reads its blocks
    status, body = complete(d, VICTIM, victim)
    assert status == 200 and body["choices"][0]["token_ids"] == open_cluster.refs[VICTIM], body
    assert body["kvbridge"]["num_external_tokens"] > 0
    assert_clean(p, d)


def test_with_a_secret_a_badly_signed_frame_never_reaches_the_decoder(secret_prefill):
    address = f"tcp://127.0.0.1:{secret_prefill.ports('prefill')[1]}"
    garbage = b"\xc1" * 64  # 0xc1 is never valid msgpack: decoding it would be a "malformed" error
    frame = msgspec.msgpack.encode([1, garbage, os.urandom(16), time.time_ns(), os.urandom(32), b"x"])
    reply = side_channel_send(address, frame)
    assert reply is not None and reply["type"] == "error", reply
    assert reply["code"] == "auth", f"the payload was decoded before the MAC was checked: {reply}"
    # and an unsigned frame with a valid message is refused for its missing signature, as before
    reply = side_channel_message(address, {"type": "ping", "engine_id": "x"})
    assert reply is not None and reply["code"] == "auth", reply
    assert_clean(secret_prefill.url("prefill"))
