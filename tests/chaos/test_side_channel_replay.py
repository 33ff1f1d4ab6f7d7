"""Signed side-channel frames captured on the wire cannot be replayed to another node or to a
restarted one (nodes share KVBRIDGE_SIDE_CHANNEL_SECRET; the attacker does not know it).

A relay between the decode node and prefill A keeps a copy of every frame the decode node sends,
signed for A. Each is then sent again, unchanged, to prefill B (same secret) and to A restarted
on the same ports with the same engine id: both refuse it (ErrorReply with code "auth").

Handshakes and pings are exempt by design (side_channel.py): they change nothing and are sent
before the client knows which instance answers, so only frames that act on leases are replayed.
"""

from __future__ import annotations

import time

import pytest
from chaos_harness import (
    NodeSet,
    assert_clean,
    assert_correct,
    complete,
    prefill,
    prompt,
    references,
)
from chaos_sockets import FrameRelay, message_type, side_channel_send

from kvbridge.transfer.address_proof import SideChannelAddress, prove_address

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SECRET = "chaos-suite-replay-secret-of-32-bytes"
ENV = {"KVBRIDGE_SIDE_CHANNEL_SECRET": SECRET}
READ_ONLY = {"hs_req", "ping"}  # message tags a server answers whatever instance they name
REPLAY_WINDOW_S = 30.0  # auth.FrameSigner's default: a replay later than this is refused as stale anyway
TEXT = prompt("replay-captured", 120)


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill-a", "prefill", ["--engine-id", "chaos-prefill-a"], env=ENV)
        nodes.start("prefill-b", "prefill", env=ENV)
        nodes.start("decode", "decode", env=ENV)
        nodes.refs = references([TEXT])
        nodes.wait()
        yield nodes


def _assert_all_refused(address: str, frames: list[bytes]) -> None:
    for frame in frames:
        reply = side_channel_send(address, frame)
        print(f"replayed {message_type(frame)} to {address}: {reply}")
        assert reply is not None, f"{address} did not answer a replayed frame"
        assert reply["type"] == "error" and reply["code"] == "auth", (
            f"{address} accepted a {message_type(frame)} frame signed for another node: {reply}"
        )


def via_relay(params: dict, port: int) -> dict:
    """`params` pointing at `port` on the prefill's host, vouched for with the cluster's secret."""
    address = SideChannelAddress(params["remote_engine_id"], params["remote_incarnation"], params["remote_host"], port)
    mac = prove_address(SECRET.encode(), address, params["remote_address_expires_at"])
    return {**params, "remote_port": port, "remote_address_mac": mac}


def test_captured_frames_are_refused_by_another_node_and_by_a_restarted_one(cluster):
    a, d = cluster.url("prefill-a"), cluster.url("decode")
    params = prefill(a, TEXT)
    relay = FrameRelay(cluster.side_channel("prefill-a"))
    try:
        # The decode connects only to addresses vouched for with the secret: the test holds it, so it
        # vouches for its relay (an attacker without the secret cannot; test_side_channel_default_auth.py).
        status, body = complete(d, TEXT, via_relay(params, relay.port))
        assert_correct(status, body, cluster.refs[TEXT])
    finally:
        relay.close()
    captured_at = time.monotonic()
    print("captured:", [message_type(f) for f in relay.captured])
    frames = [f for f in relay.captured if message_type(f) not in READ_ONLY]
    assert frames, "the decode node sent no lease message (TransferDone) through the relay"

    _assert_all_refused(cluster.side_channel("prefill-b"), frames)

    cluster.kill("prefill-a")
    cluster.start("prefill-a", "prefill", ["--engine-id", "chaos-prefill-a"], env=ENV, ports=cluster.ports("prefill-a"))
    cluster.wait("prefill-a")
    elapsed = time.monotonic() - captured_at
    assert elapsed < REPLAY_WINDOW_S - 5, (
        f"precondition: the restart took {elapsed:.0f}s, so a refusal could come from the replay window "
        "and not from the incarnation; rerun on a less loaded machine"
    )
    _assert_all_refused(cluster.side_channel("prefill-a"), frames)
    assert_clean(cluster.url("prefill-a"), cluster.url("prefill-b"), d)
