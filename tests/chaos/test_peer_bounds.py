"""An HTTP client decides which peers a decode node talks to; that must cost bounded state and
reach only the peers the operator allowed.

200 requests naming 200 ports nobody listens on must not leave the decode node with hundreds of
threads, nor lock a real prefill engine that it meets afterwards out of P/D; a request naming a
host outside the `allowed_peers` option must not open a connection.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from chaos_harness import (
    FAST_FAIL,
    NodeSet,
    assert_clean,
    assert_correct,
    assert_no_remote_kv,
    complete,
    external_tokens,
    num_threads,
    prefill,
    prompt,
    state,
    references,
)
from chaos_sockets import TcpListener

from kvbridge.serve.launcher import free_ports

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

NUM_PEERS = 200
MAX_EXTRA_THREADS = 20
THREADS_TIMEOUT_S = 60.0  # idle peers are forgotten well inside it
# Each made-up peer costs the decode node one handshake timeout; half of FAST_FAIL's second is still
# far above a loopback handshake with the real prefill nodes.
DECODE_OPTIONS = {**FAST_FAIL, "handshake_timeout_s": 0.5, "allowed_peers": ["127.0.0.1"]}
WARM, BURST, OUTSIDE = prompt("bounds-warm", 80), prompt("bounds-burst", 60), prompt("bounds-outside", 80)
LATE = prompt("bounds-late-prefill", 80)


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("late-prefill", "prefill")  # first read by the decode node after the burst
        nodes.start("decode", "decode", ["--kv-connector-extra", json.dumps(DECODE_OPTIONS)])
        nodes.refs = references([WARM, BURST, OUTSIDE, LATE])
        nodes.wait()
        yield nodes


def test_requests_naming_many_peers_grow_no_threads_and_lock_no_prefill_out(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    status, body = complete(d, WARM, prefill(p, WARM))  # every thread an honest P/D read needs exists now
    assert_correct(status, body, cluster.refs[WARM], allow_error=False)
    assert external_tokens(body) > 0
    baseline = num_threads(cluster.pid("decode"))

    honest = prefill(p, BURST)  # a real block hash and lease; only the port is made up
    ports = free_ports(NUM_PEERS)
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda port: complete(d, BURST, {**honest, "remote_port": port}), ports))
    for status, body in answers:
        assert_correct(status, body, cluster.refs[BURST])
        assert_no_remote_kv(status, body)
    print("answers:", {s: sum(1 for a in answers if a[0] == s) for s in {a[0] for a in answers}})
    status, body = complete(d, BURST, honest)  # releases the real lease
    assert_correct(status, body, cluster.refs[BURST], allow_error=False)

    deadline = time.monotonic() + THREADS_TIMEOUT_S
    while (threads := num_threads(cluster.pid("decode"))) > baseline + MAX_EXTRA_THREADS and time.monotonic() < deadline:
        time.sleep(0.5)
    assert threads <= baseline + MAX_EXTRA_THREADS, (
        f"decode node has {threads} threads {THREADS_TIMEOUT_S:.0f}s after requests naming {NUM_PEERS} "
        f"peers (baseline {baseline}): per-peer state is not bounded or never expires"
    )
    print(f"threads: baseline {baseline}, after the burst {threads}")

    late = cluster.url("late-prefill")  # a prefill engine this decode node never talked to
    status, body = complete(d, LATE, prefill(late, LATE))
    assert_correct(status, body, cluster.refs[LATE], allow_error=False)
    worker = state(d)["stats"]["connector"]["worker"]
    assert external_tokens(body) > 0, f"requests naming made-up peers locked a real prefill engine out of P/D: {worker}"
    assert_clean(p, late, d)


def test_peer_outside_the_allow_list_is_never_contacted(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    listener = TcpListener(host="127.0.0.2")  # loopback, but not an allowed peer
    try:
        honest = prefill(p, OUTSIDE)
        status, body = complete(d, OUTSIDE, {**honest, "remote_host": "127.0.0.2", "remote_port": listener.port})
        print("outside the allow-list:", status, body)
        assert_correct(status, body, cluster.refs[OUTSIDE])
        assert_no_remote_kv(status, body)
        status, body = complete(d, OUTSIDE, honest)
        assert_correct(status, body, cluster.refs[OUTSIDE], allow_error=False)
        assert listener.num_connections == 0, f"the decode node connected to 127.0.0.2 {listener.num_connections} times"
    finally:
        listener.close()
    assert_clean(p, d)
