"""Leases are renewed on the prefill's clock: a prefill node with a short `lease_s` keeps a read's
blocks through a handshake that lasts longer than that term, because the decode node renews every
min(its own lease_s, the params' lease_s) / 3 from the read's admission, handshakes included.

The prefill's side channel is reached through a relay that answers handshakes 3 s late (a slow
peer); its leases last 1.5 s; the decode node keeps its default lease_s (30 s).
"""

from __future__ import annotations

import pytest
from chaos_harness import NodeSet, assert_clean, assert_correct, complete, external_tokens, prefill, prompt, references
from chaos_sockets import FrameRelay

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SLOW = prompt("lease-clock-slow-handshake", 180)
LEASE_S = 1.5
HANDSHAKE_DELAY_S = 3.0  # two lease terms: without renewals during it, the lease expires


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill", extra=["--kv-connector-extra", f'{{"lease_s": {LEASE_S}}}'])
        nodes.start("decode", "decode")
        nodes.refs = references([SLOW])
        nodes.wait()
        yield nodes


def test_a_handshake_longer_than_the_prefills_lease_term_keeps_the_lease(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    relay = FrameRelay(cluster.side_channel("prefill"), delay_replies={"hs_req": HANDSHAKE_DELAY_S})
    try:
        params = prefill(p, SLOW)
        assert params["lease_s"] == LEASE_S
        status, body = complete(d, SLOW, {**params, "remote_port": relay.port})
        assert_correct(status, body, cluster.refs[SLOW], allow_error=False)
        assert external_tokens(body) > 0, "the lease expired during the handshake: the prompt was recomputed"
    finally:
        relay.close()
    assert_clean(p, d)
