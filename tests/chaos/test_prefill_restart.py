"""A prefill node is killed (SIGKILL) and restarted on the same ports with the same engine id.

Two decode nodes: one that never talked to the old process, one that had read from it (a cached
peer, whose NIXL agent is now dead). Params that the old process returned must never be served
from the new process's blocks: a correct recompute or a clear error. New requests through the
restarted prefill are then pulled again by both decode nodes, not recomputed forever.
"""

from __future__ import annotations

import json

import pytest
from chaos_harness import (
    FAST_FAIL,
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

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

ENGINE_ID = "chaos-prefill"  # an operator's fixed id: only the process's incarnation tells them apart
WARM, OLD = prompt("restart-warm", 100), prompt("restart-old", 180)
NEW = [prompt(f"restart-new{i}", 140) for i in range(6)]
DECODES = ("decode-fresh", "decode-cached")
MAX_ATTEMPTS = 3  # new requests allowed to fail over to a recompute while the decode forgets the old peer


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill", ["--engine-id", ENGINE_ID])
        for name in DECODES:
            nodes.start(name, "decode", ["--kv-connector-extra", json.dumps(FAST_FAIL)])
        nodes.refs = references([WARM, OLD, *NEW])
        nodes.wait()
        yield nodes


@pytest.fixture(scope="module")
def old_params(cluster):
    """Params of the killed process, after the restart; decode-cached had read from the old one."""
    p = cluster.url("prefill")
    params = prefill(p, WARM)
    status, body = complete(cluster.url("decode-cached"), WARM, params)
    assert_correct(status, body, cluster.refs[WARM], allow_error=False)
    assert external_tokens(body) > 0
    old = prefill(p, OLD)
    cluster.kill("prefill")
    cluster.start("prefill", "prefill", ["--engine-id", ENGINE_ID], ports=cluster.ports("prefill"))
    cluster.wait("prefill")
    churn(p, "restart")  # the new process's blocks hold other prompts' KV
    return old


def test_old_processes_params_are_never_served_from_the_new_process(cluster, old_params):
    for name in reversed(DECODES):
        status, body = complete(cluster.url(name), OLD, old_params)
        print(f"{name} with the old process's params:", status, body)
        assert_correct(status, body, cluster.refs[OLD])
        assert_no_remote_kv(status, body)
    assert_clean(cluster.url("prefill"), *(cluster.url(n) for n in DECODES))


@pytest.mark.parametrize("decode", DECODES)
def test_restarted_prefill_is_pulled_from_again(cluster, old_params, decode):
    p, d = cluster.url("prefill"), cluster.url(decode)
    prompts = NEW[:MAX_ATTEMPTS] if decode == DECODES[0] else NEW[MAX_ATTEMPTS:]
    pulled = []
    for text in prompts:
        status, body = complete(d, text, prefill(p, text))
        assert_correct(status, body, cluster.refs[text], allow_error=False)
        pulled.append(external_tokens(body))
    print(f"{decode}: tokens pulled per new request: {pulled}")
    assert pulled[-1] > 0, f"{decode} recomputes every request after the prefill restarted: {pulled}"
    assert_clean(p, d)
