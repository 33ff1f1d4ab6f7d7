"""Made-up ids and absurd values in the kv_transfer_params a decode node is sent.

Each starts from real params (a live lease on the prompt's blocks) and changes one thing. The
answer is a 4xx naming the problem or the correct tokens (recomputed when the blocks cannot be
read), within a deadline that detects a hang; the node stays healthy and nothing leaks. After
each, the honest params still work.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from chaos_harness import (
    FAST_FAIL,
    NUM_BLOCKS,
    NodeSet,
    assert_clean,
    assert_correct,
    assert_no_remote_kv,
    churn,
    complete,
    free_port,
    prefill,
    prompt,
    references,
)
from chaos_sockets import TcpListener

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BAD_REQUEST_TIMEOUT_S = 30.0  # FAST_FAIL gives up on a peer in ~5 s; past this it hangs


def _ids(params: dict, fn: Callable[[list[int]], list[int]]) -> dict:
    return {**params, "remote_block_ids": fn(list(params["remote_block_ids"]))}


# name -> params of a live lease -> the params an attacker (or a buggy client) sends instead
CASES: dict[str, Callable[[dict], dict]] = {
    "block_id_beyond_block_count": lambda p: _ids(p, lambda ids: [NUM_BLOCKS + 7 - i for i in range(len(ids))]),
    "block_id_int64_max": lambda p: _ids(p, lambda ids: [*ids[:-1], 2**63 - 1]),
    "block_id_negative": lambda p: _ids(p, lambda ids: [*ids[:-1], -1]),
    "block_ids_huge_list": lambda p: _ids(p, lambda ids: list(range(NUM_BLOCKS)) * 4000),
    "block_ids_empty": lambda p: _ids(p, lambda ids: []),
    "num_tokens_absurd": lambda p: {**p, "remote_num_tokens": -(2**40)},
    "block_size_absurd": lambda p: {**p, "remote_block_size": 2**62},
    "lease_absurd": lambda p: {**p, "lease_s": -1e308},
    "request_id_made_up": lambda p: {**p, "remote_request_id": "cmpl-made-up"},
    "lease_token_made_up": lambda p: {**p, "remote_lease_token": "00" * 32},
    "incarnation_made_up": lambda p: {**p, "remote_incarnation": "00" * 16},
    "wrong_engine_id": lambda p: {**p, "remote_engine_id": "not-" + p["remote_engine_id"]},
    "port_nobody_listens_on": lambda p: {**p, "remote_port": free_port()},
    "port_out_of_range": lambda p: {**p, "remote_port": 2**16 + 1},
    "host_not_an_address": lambda p: {**p, "remote_host": "no such host"},
    "block_id_2_pow_63": lambda p: _ids(p, lambda ids: [*ids[:-1], 2**63]),  # last: it once killed the engine
}
# Cases whose block hash and lease still prove the blocks: reading them is allowed, refusing too.
STILL_PROVEN = {"num_tokens_absurd", "lease_absurd"}


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("other-prefill", "prefill")
        nodes.start("decode", "decode", ["--kv-connector-extra", json.dumps(FAST_FAIL)])
        nodes.refs = references([prompt(f"absurd-{name}", 150) for name in [*CASES, "tcp-listener", "other-prefill"]])
        nodes.wait()
        yield nodes


def _attack(cluster: NodeSet, text: str, forge: Callable[[dict], dict], is_proven: bool = False) -> None:
    """Send forged params for `text`, check the answer, then read honestly (releasing the lease)."""
    p, d, expected = cluster.url("prefill"), cluster.url("decode"), cluster.refs[text]
    honest = prefill(p, text)
    status, body = complete(d, text, forge(honest), timeout_s=BAD_REQUEST_TIMEOUT_S)
    print("forged params:", status, str(body)[:600])
    assert_correct(status, body, expected)
    if not is_proven:
        assert_no_remote_kv(status, body)
    assert status < 500, f"a client's bad params must be a 4xx, not {status}: {body}"
    status2, body2 = complete(d, text, honest)
    assert_correct(status2, body2, expected, allow_error=False)
    assert_clean(p, d)


@pytest.mark.parametrize("case", list(CASES))
def test_absurd_params_are_refused_or_recomputed(cluster, case):
    _attack(cluster, prompt(f"absurd-{case}", 150), CASES[case], is_proven=case in STILL_PROVEN)


def test_port_of_a_non_kvbridge_listener(cluster):
    listener = TcpListener()
    try:
        _attack(cluster, prompt("absurd-tcp-listener", 150), lambda p: {**p, "remote_port": listener.port})
    finally:
        listener.close()


def test_port_of_another_prefill(cluster):
    other = cluster.url("other-prefill")
    churn(other, "other-prefill")  # its blocks hold other prompts' KV at every id
    _attack(cluster, prompt("absurd-other-prefill", 150), lambda p: {**p, "remote_port": cluster.ports("other-prefill")[1]})
    assert_clean(other)
