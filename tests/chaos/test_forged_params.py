"""A decode node is handed kv_transfer_params that do not prove the blocks are this prompt's.

Stale params whose blocks the prefill has since reused, a victim's params with the block hash (or
the lease's incarnation or token) stripped, and params whose hash is right (the attacker's own
prompt) but whose block ids are a victim's lease. Each must end in the correct tokens (recomputed)
or a clear error, never in another prompt's KV; a stripped field is refused outright with a 400
naming it.
"""

from __future__ import annotations

import pytest
from chaos_harness import (
    NodeSet,
    assert_clean,
    assert_correct,
    assert_no_remote_kv,
    assert_refused,
    churn,
    complete,
    external_tokens,
    load_errors,
    prefill,
    prompt,
    references,
    request,
)

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

STALE = prompt("stale-A", 170)
# What proves that remote blocks are a prompt's: the hash of its tokens, and the lease (instance, token).
PROOF_FIELDS = ("remote_block_hash", "remote_incarnation", "remote_lease_token")
MISSING = {f: (prompt(f"missing-{f}-victim", 200), prompt(f"missing-{f}-attacker", 200)) for f in PROOF_FIELDS}
FORGED_VICTIM, FORGED_ATTACKER = prompt("forged-victim", 200), prompt("forged-attacker", 150)
SIZE_VICTIM, SIZE_ATTACKER = prompt("block-size-victim", 200), prompt("block-size-attacker", 200)


@pytest.fixture(scope="module")
def cluster():
    with NodeSet() as nodes:
        nodes.start("prefill", "prefill")
        nodes.start("decode", "decode")
        nodes.refs = references([STALE, *sum(MISSING.values(), ()), FORGED_VICTIM, FORGED_ATTACKER, SIZE_VICTIM, SIZE_ATTACKER])
        nodes.wait()
        yield nodes


def test_stale_params_after_the_prefill_reused_the_blocks(cluster):
    p, d, expected = cluster.url("prefill"), cluster.url("decode"), cluster.refs[STALE]
    params = prefill(p, STALE)
    status, body = complete(d, STALE, params)
    assert_correct(status, body, expected, allow_error=False)
    assert external_tokens(body) > 0  # read from the prefill, which released the lease
    churn(p, "stale")  # every block the lease covered now holds other prompts' KV
    status, reset = request(d, "/v1/kvbridge/reset_prefix_cache", {})  # the decode must read again
    assert status == 200 and reset == {"reset": True}, reset

    errors_before = load_errors(d)
    status, body = complete(d, STALE, params)  # the same, old params
    print("stale replay:", status, body)
    assert_correct(status, body, expected)
    assert_no_remote_kv(status, body)
    if status == 200:
        assert load_errors(d) > errors_before, "the read of released blocks was not counted as a load error"
    assert_clean(p, d)


@pytest.mark.parametrize("field", PROOF_FIELDS)
def test_params_missing_a_proof_field_are_refused(cluster, field):
    p, d = cluster.url("prefill"), cluster.url("decode")
    victim_text, attacker_text = MISSING[field]
    victim = prefill(p, victim_text)
    stripped = {k: v for k, v in victim.items() if k != field}
    status, body = complete(d, attacker_text, stripped)
    print(f"without {field}:", status, body)
    assert_correct(status, body, cluster.refs[attacker_text])
    assert_refused(status, body, field)

    status, body = complete(d, victim_text, victim)  # the victim's own read is untouched
    assert_correct(status, body, cluster.refs[victim_text], allow_error=False)
    status, body = complete(d, attacker_text)  # and the decode node's cache holds no foreign KV
    assert_correct(status, body, cluster.refs[attacker_text], allow_error=False)
    assert_clean(p, d)


def test_own_block_hash_with_a_victims_block_ids(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    victim = prefill(p, FORGED_VICTIM)
    own = prefill(p, FORGED_ATTACKER)  # a valid hash, token and incarnation for the attacker's prompt
    num_blocks = len(own["remote_block_ids"])
    assert len(victim["remote_block_ids"]) >= num_blocks
    forged = {**own, "remote_block_ids": victim["remote_block_ids"][:num_blocks]}
    status, body = complete(d, FORGED_ATTACKER, forged)
    print("forged:", status, body)
    assert_correct(status, body, cluster.refs[FORGED_ATTACKER])
    assert_no_remote_kv(status, body)

    status, body = complete(d, FORGED_VICTIM, victim)
    assert_correct(status, body, cluster.refs[FORGED_VICTIM], allow_error=False)
    status, body = complete(d, FORGED_ATTACKER, own)  # the attacker's honest read releases its lease
    assert_correct(status, body, cluster.refs[FORGED_ATTACKER], allow_error=False)
    status, body = complete(d, FORGED_ATTACKER)  # no foreign KV cached under the attacker's prompt
    assert_correct(status, body, cluster.refs[FORGED_ATTACKER], allow_error=False)
    assert_clean(p, d)


def test_victims_params_claiming_another_block_size(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    victim = prefill(p, SIZE_VICTIM)
    status, body = complete(d, SIZE_ATTACKER, {**victim, "remote_block_size": 32})  # hashes of other blocks
    print("other block size:", status, body)
    assert_correct(status, body, cluster.refs[SIZE_ATTACKER])
    assert_no_remote_kv(status, body)

    status, body = complete(d, SIZE_VICTIM, victim)
    assert_correct(status, body, cluster.refs[SIZE_VICTIM], allow_error=False)
    status, body = complete(d, SIZE_ATTACKER)
    assert_correct(status, body, cluster.refs[SIZE_ATTACKER], allow_error=False)
    assert_clean(p, d)
