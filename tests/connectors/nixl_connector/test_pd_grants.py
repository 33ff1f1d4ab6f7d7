"""The signed grant a prefill returns in kv_transfer_params (transfer/grants.py), attacked end to end:
a prefill engine in another OS process, real NIXL over UCX on loopback, the decode in this process.

With a valid grant the decode verifies what it read against the grant's digests and asks the prefill
nothing before it uses the blocks. Anything a client can do to the params (alter the grant, forge
one, move one to another request's params) must leave the tokens right: the decode falls back to
confirming the read with the prefill, which answers only for the lease it granted.
"""

from __future__ import annotations

import base64

import pytest
from prefill_node import BLOCK_SIZE, PrefillNode, engine_kwargs, prefill_node
from test_pd import GREEDY, colocated, decode_engine, same_length_prompts

from kvbridge.transfer import messages as m
from kvbridge.transfer.grants import GrantSigner

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def node():
    with prefill_node(**engine_kwargs("prefill-grants", "kv_producer")) as n:
        yield n


def prompts_of(seed: int, count: int = 3) -> list[dict]:
    return same_length_prompts(seed, 3 * BLOCK_SIZE + 5, count)


def worker_stats(dec) -> dict:
    return dec.get_stats()["connector"]["worker"]


def wait_released(node: PrefillNode) -> dict:
    state = node.wait_until(lambda s: s["num_used_blocks"] == 0, timeout_s=10)
    assert state["num_used_blocks"] == 0 and state["connector"]["worker"]["num_leases"] == 0, state
    return state


def test_a_granted_read_is_used_without_asking_the_prefill(node: PrefillNode, reference, monkeypatch):
    prompts = prompts_of(seed=31)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    assert all(p["remote_grant"] for p in params)
    # a confirmation on the side channel would now wait 5 s: a granted read must not send one
    monkeypatch.setenv("KVBRIDGE_FAULT_DELAY_CONFIRM_S", "5")
    with decode_engine("decode-granted") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.num_external_tokens == 3 * BLOCK_SIZE for o in outs)
        worker = worker_stats(dec)
        assert worker["num_granted_reads"] == len(prompts) and worker["num_unusable_grants"] == 0
        assert worker["num_digested_bytes"] == worker["bytes_transferred"] > 0
        assert worker["confirm_ms_p99"] < 1000  # landed -> usable: no 5 s confirmation in it
    wait_released(node)  # the release that followed freed the prefill's blocks, well before the lease ends


def _tamper(grant: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(grant))
    raw[-1] ^= 1  # one bit of the signed body
    return base64.urlsafe_b64encode(bytes(raw)).decode()


def _forged(params: dict) -> str:
    """A well-formed grant for the params' own lease, with digests of zeros, signed by a key of ours."""
    lease = m.LeaseRef(req_id=params["remote_request_id"], token=params["remote_lease_token"],
                       block_ids=params["remote_block_ids"], block_hash=params["remote_block_hash"])  # fmt: skip
    digest = m.KVDigest(alg="xxh3-64", values=[0] * len(lease.block_ids))
    return GrantSigner().sign(lease, params["remote_incarnation"], digest, lease_s=60)


@pytest.mark.parametrize("attack", ["tampered", "forged", "swapped", "garbage"])
def test_a_grant_a_client_altered_is_never_relied_on(node: PrefillNode, reference, attack: str):
    prompts = prompts_of(seed=32)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    if attack == "tampered":
        params = [p | {"remote_grant": _tamper(p["remote_grant"])} for p in params]
    elif attack == "forged":
        params = [p | {"remote_grant": _forged(p)} for p in params]
    elif attack == "swapped":  # each request carries the next one's genuine grant
        params = [p | {"remote_grant": params[(i + 1) % len(params)]["remote_grant"]} for i, p in enumerate(params)]
    else:
        params = [p | {"remote_grant": "%%not base64%%" * 1000} for p in params]
    with decode_engine(f"decode-{attack}") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want
        worker = worker_stats(dec)
        assert worker["num_granted_reads"] == 0 and worker["num_unusable_grants"] == len(prompts)
        # each read was confirmed by the prefill instead, and used: the KV still came from the prefill
        assert all(o.num_external_tokens == 3 * BLOCK_SIZE for o in outs)
        assert worker["num_load_errors"] == 0
    wait_released(node)


def test_a_granted_read_whose_bytes_differ_is_recomputed(node: PrefillNode, reference, monkeypatch):
    prompts = prompts_of(seed=33, count=1)
    want = colocated(reference, prompts)
    params = node.prefill(prompts)
    monkeypatch.setenv("KVBRIDGE_FAULT_FLIP_READ_BIT", "1")  # one bit flipped in the landed bytes
    with decode_engine("decode-flipped") as dec:
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
        assert [o.outputs[0].token_ids for o in outs] == want  # recomputed, never served from the bad read
        assert outs[0].num_external_tokens == 0
        worker = worker_stats(dec)
        assert worker["num_digest_mismatches"] == 1 and worker["num_granted_reads"] == 0
    wait_released(node)  # the failed read still released the lease


def test_a_prefill_that_does_not_sign_is_confirmed_as_before(reference):
    prompts = prompts_of(seed=34, count=2)
    want = colocated(reference, prompts)
    with prefill_node(**engine_kwargs("prefill-unsigned", "kv_producer", kv={"extra": {"sign_grants": False}})) as n:
        params = n.prefill(prompts)
        assert not any(p["remote_grant"] for p in params)
        with decode_engine("decode-unsigned") as dec:
            outs = dec.generate(prompts, GREEDY, kv_transfer_params=params)
            assert [o.outputs[0].token_ids for o in outs] == want
            worker = worker_stats(dec)
            assert worker["num_granted_reads"] == worker["num_unusable_grants"] == 0
            assert worker["num_digested_bytes"] == worker["bytes_transferred"] > 0
        wait_released(n)


def test_a_synchronous_load_that_cannot_be_made_is_recomputed_in_its_step(node: PrefillNode, reference, monkeypatch):
    """sync_ipc_reads attacked at its one race: the worker named the prefill as readable on its device,
    the scheduler matched granted requests as loads in their step, and then the read cannot go that way
    (here every known peer is named, and on a CPU no read can). Each such load is a load error in the
    step that scheduled it: the engine drops the token that step computed on the unread blocks and
    computes the prompt, so the tokens stay right, and the prefill's blocks are released at once."""
    from kvbridge.transfer.endpoint import KVEndpoint

    monkeypatch.setattr(KVEndpoint, "in_step_peers", lambda self: [(a, self.peers.get(a)) for a in self.peers.addresses()])
    prompts = prompts_of(seed=37)
    want = colocated(reference, prompts)
    with decode_engine("decode-sync-refused", extra={"sync_ipc_reads": True}) as dec:
        first = prompts_of(seed=38, count=1)
        dec.generate(first, GREEDY, kv_transfer_params=node.prefill(first))  # the handshake, asynchronously
        before = worker_stats(dec)
        assert before["num_refused_sync_reads"] == 0 and before["num_granted_reads"] == 1, before
        outs = dec.generate(prompts, GREEDY, kv_transfer_params=node.prefill(prompts))
        assert [o.outputs[0].token_ids for o in outs] == want
        worker = worker_stats(dec)
        assert worker["num_refused_sync_reads"] == len(prompts) and worker["num_sync_reads"] == 0, worker
        assert worker["num_transfers"] == before["num_transfers"]  # nothing was read
        assert worker["num_load_errors"] - before["num_load_errors"] == 3 * len(prompts), worker
    wait_released(node)
