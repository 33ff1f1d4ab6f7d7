"""NixlConnector bookkeeping without NIXL: params, options, the scheduler half, leases, metrics."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import KVConnectorOutput, SchedulerOutput
from kvbridge.connectors.nixl.leases import EARLY_ABANDON_S, MAX_EARLY_ABANDONS, LeaseTable
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.peer_policy import PeerPolicy
from kvbridge.connectors.nixl.scheduler import (
    DEVICE_READ_PEERS_STAT,
    SIDE_CHANNEL_PORT_STAT,
    UNREACHABLE_PEERS_STAT,
    NixlScheduler,
    unreachable_peer_key,
)
from kvbridge.connectors.nixl.stats import TransferStats, busy_seconds
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import ConfigError, InvalidRequestError
from kvbridge.kv_transfer_params import MAX_REMOTE_BLOCKS, parse_remote_prefill
from kvbridge.transfer.messages import KVDigest, LeaseRef
from kvbridge.transfer.options import DescriptorMode, TransferOptions

BS = 16


def token_ids(num_tokens: int) -> list[int]:
    return list(range(3, 3 + num_tokens))


def remote_params(block_ids, port=5555, num_tokens=None, host="127.0.0.1") -> dict:
    """Params as a prefill of `num_tokens` prompt tokens (default: exactly the blocks) returns them."""
    num_tokens = len(block_ids) * BS if num_tokens is None else num_tokens
    prefilled = Request("pre-r1", token_ids(num_tokens), SamplingParams(), BS)
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "pre",
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": list(block_ids),
        "remote_request_id": "pre-r1",
        "remote_block_hash": prefilled.block_hashes[len(block_ids) - 1].hex() if block_ids else "",
        "remote_incarnation": "inc-0",
        "remote_lease_token": "t" * 64,
    }


def request(num_tokens: int, params: dict | None = None, req_id: str = "r1") -> Request:
    return Request(req_id, token_ids(num_tokens), SamplingParams(max_tokens=4), BS, params)


def scheduler(role: str, allowed_peers=("127.0.0.0/8",)) -> NixlScheduler:
    config = KVTransferConfig("NixlConnector", role=role, engine_id="me", side_channel_port=0)
    return NixlScheduler(config, BS, 30.0, "inc-me", PeerPolicy(allowed_peers))


def test_params_are_validated_with_named_errors():
    assert parse_remote_prefill(None) is None
    assert parse_remote_prefill({"do_remote_decode": True}) is None
    assert parse_remote_prefill(remote_params([1, 2])).remote_block_ids == [1, 2]
    with pytest.raises(InvalidRequestError, match="remote_block_ids"):
        parse_remote_prefill({**remote_params([1]), "remote_block_ids": "oops"})
    with pytest.raises(InvalidRequestError, match="remote_engine_id"):
        parse_remote_prefill({k: v for k, v in remote_params([1]).items() if k != "remote_engine_id"})
    with pytest.raises(InvalidRequestError, match="port"):
        parse_remote_prefill(remote_params([1], port=0))


@pytest.mark.parametrize("field", ["remote_block_hash", "remote_incarnation", "remote_lease_token"])
def test_params_without_the_proof_of_their_blocks_are_refused(field):
    without = {k: v for k, v in remote_params([1, 2]).items() if k != field}
    with pytest.raises(InvalidRequestError, match=f"{field} is required"):
        parse_remote_prefill(without)
    with pytest.raises(InvalidRequestError, match=f"{field} is required"):
        parse_remote_prefill({**without, field: ""})  # an empty value skips nothing either


@pytest.mark.parametrize(
    "block_ids, match",
    [([1, 2**63], "outside"), ([-1], "outside"), ([0] * (MAX_REMOTE_BLOCKS + 1), "more than")],
)
def test_absurd_block_ids_are_refused_before_anything_is_planned(block_ids, match):
    with pytest.raises(InvalidRequestError, match=match):
        parse_remote_prefill({**remote_params([1]), "remote_block_ids": block_ids})


def test_peer_policy_allows_networks_and_exact_names_only():
    policy = PeerPolicy(("10.0.0.0/16", "::1", "Prefill-0.svc"))
    assert policy.allows("10.0.3.4") and policy.allows("::1") and policy.allows("[::1]") and policy.allows("prefill-0.svc")
    assert not policy.allows("10.1.0.1") and not policy.allows("127.0.0.1") and not policy.allows("prefill-0.svc.evil")
    assert PeerPolicy().allows("127.0.0.2") and not PeerPolicy().allows("192.168.1.1")  # default: loopback only
    assert PeerPolicy(("*",)).allows("anything")
    with pytest.raises(ConfigError, match="allowed_peers"):
        NixlOptions.from_extra({"allowed_peers": ["10.0.0.0/99"]})
    assert NixlOptions.from_extra({"allowed_peers": "*"}).allowed_peers == ("*",)


def test_decode_refuses_params_naming_a_peer_outside_the_allow_list():
    sched = scheduler("kv_consumer")
    req = request(2 * BS, remote_params([7, 8], host="169.254.169.254"))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed locally, nothing planned
    assert sched.build_connector_meta(SchedulerOutput()).recvs == {}
    assert sched.get_stats()["num_refused_peers"] == 1


def test_decode_computes_requests_naming_an_unreachable_side_channel_until_the_cooldown_ends():
    now = [100.0]
    config = KVTransferConfig("NixlConnector", role="kv_consumer", engine_id="me", side_channel_port=0)
    sched = NixlScheduler(config, BS, 30.0, "inc-me", PeerPolicy(), unreachable_cooldown_s=10.0, clock=lambda: now[0])
    dead = unreachable_peer_key("tcp://127.0.0.1:5555", "inc-0")
    sched.update_connector_output(KVConnectorOutput(stats={UNREACHABLE_PEERS_STAT: [dead]}))
    refused = request(2 * BS, remote_params([7, 8]), req_id="r1")
    assert sched.get_num_new_matched_tokens(refused, 0) == (0, False)  # before admission: no load error
    assert "PeerUnreachableError" in sched.take_refusal("r1")
    other_port = request(2 * BS, remote_params([7, 8], port=5556), req_id="r2")
    assert sched.get_num_new_matched_tokens(other_port, 0) == (2 * BS, True)
    # the engine restarted at the same address is another incarnation: its leases are read at once
    restarted = request(2 * BS, {**remote_params([7, 8]), "remote_incarnation": "inc-1"}, req_id="r4")
    assert sched.get_num_new_matched_tokens(restarted, 0) == (2 * BS, True)
    now[0] += 10.0
    assert sched.get_num_new_matched_tokens(request(2 * BS, remote_params([7, 8]), req_id="r3"), 0) == (2 * BS, True)
    assert sched.get_stats()["num_refused_unreachable"] == 1


def test_options_reject_unknown_and_bad_values():
    assert NixlOptions.from_extra({"lease_s": 3}).renew_interval_s == 1
    with pytest.raises(ConfigError, match="lease_sec"):
        NixlOptions.from_extra({"lease_sec": 3})
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        NixlOptions.from_extra({"transfer_timeout_s": 0})
    defaults = NixlOptions.from_extra({})
    assert defaults.cuda_ipc and defaults.ipc_min_runs == 16  # same-host GPU peers: CUDA IPC for scattered reads
    assert NixlOptions.from_extra({"ipc_min_runs": 1}).ipc_min_runs == 1
    with pytest.raises(ConfigError, match="ipc_min_runs"):
        NixlOptions.from_extra({"ipc_min_runs": 0})
    assert NixlOptions.from_extra({"descriptor_mode": "ranges"}).descriptor_mode is DescriptorMode.RANGES
    with pytest.raises(ConfigError, match="NixlConnector option descriptor_mode='bogus'"):
        NixlOptions.from_extra({"descriptor_mode": "bogus"})
    assert isinstance(defaults, TransferOptions)  # the endpoint takes them as they are: one set of defaults


def test_decode_asks_only_for_blocks_missing_locally_and_plans_one_read():
    sched = scheduler("kv_consumer")
    req = request(5 * BS + 3, remote_params([10, 11, 12, 13, 14], num_tokens=5 * BS + 3))
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, True)
    sched.update_state_after_alloc(req, [0, 1, 2, 3, 4, 5], 3 * BS)
    meta = sched.build_connector_meta(SchedulerOutput())
    job = meta.recvs["r1"]
    assert job.local_block_ids == (2, 3, 4) and job.remote_block_ids == (12, 13, 14)
    assert job.remote.address == "tcp://127.0.0.1:5555" and job.remote_request_id == "pre-r1"
    assert job.remote.incarnation == "inc-0" and job.lease.token == "t" * 64
    assert job.lease.block_ids == [10, 11, 12, 13, 14]  # the release names the whole lease, not the part read
    # asked once: a re-admission (after preemption) computes locally
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_connector_meta(SchedulerOutput()).recvs == {}


def test_granted_reads_from_a_device_peer_load_in_their_step_and_leave_the_last_token():
    """sync_ipc_reads: only params with a grant, naming a peer the worker reads on its device (its
    last report of them), load synchronously; such a load leaves the prompt's last token to compute
    and reads every block (the last slot is rewritten after its digest)."""
    config = KVTransferConfig("NixlConnector", role="kv_consumer", engine_id="me", side_channel_port=0)
    sched = NixlScheduler(config, BS, 30.0, "inc-me", PeerPolicy(("127.0.0.0/8",)), sync_ipc_reads=True)
    granted = {**remote_params([10, 11, 12, 13]), "remote_grant": "g" * 40}
    peer = unreachable_peer_key("tcp://127.0.0.1:5555", "inc-0")

    def match(params, req_id):
        return sched.get_num_new_matched_tokens(request(4 * BS, params, req_id), BS)

    assert match(granted, "a") == (3 * BS, True)  # the worker has not named the peer yet
    sched.update_connector_output(KVConnectorOutput(stats={DEVICE_READ_PEERS_STAT: [peer]}))
    assert match(remote_params([10, 11, 12, 13]), "b") == (3 * BS, True)  # no grant: confirmed, asynchronously
    assert match({**granted, "remote_incarnation": "inc-1"}, "c") == (3 * BS, True)  # another instance
    req = request(4 * BS, granted, "d")
    assert sched.get_num_new_matched_tokens(req, BS) == (3 * BS - 1, False)
    sched.update_state_after_alloc(req, [0, 1, 2, 3], 3 * BS - 1)
    job = sched.build_connector_meta(SchedulerOutput()).recvs["d"]
    assert job.sync and job.local_block_ids == (1, 2, 3) and job.remote_block_ids == (11, 12, 13)
    assert job.grant == "g" * 40
    # a later report without the peer (forgotten, restarted): asynchronous again; a step with no report keeps the set
    sched.update_connector_output(KVConnectorOutput(stats={}))
    assert match(granted, "e") == (3 * BS - 1, False)
    sched.update_connector_output(KVConnectorOutput(stats={DEVICE_READ_PEERS_STAT: []}))
    req = request(4 * BS, granted, "f")
    assert sched.get_num_new_matched_tokens(req, BS) == (3 * BS, True)
    sched.update_state_after_alloc(req, [0, 1, 2, 3], 3 * BS)
    assert not sched.build_connector_meta(SchedulerOutput()).recvs["f"].sync


def test_without_sync_ipc_reads_every_read_is_asynchronous():
    sched = scheduler("kv_consumer")
    sched.update_connector_output(
        KVConnectorOutput(stats={DEVICE_READ_PEERS_STAT: [unreachable_peer_key("tcp://127.0.0.1:5555", "inc-0")]})
    )
    granted = {**remote_params([10, 11]), "remote_grant": "g" * 40}
    assert sched.get_num_new_matched_tokens(request(2 * BS, granted), 0) == (2 * BS, True)


def test_remote_blocks_of_another_prompt_are_never_read():
    producer = scheduler("kv_producer")
    prefilled = request(3 * BS + 2, {"do_remote_decode": True})
    prefilled.num_computed_tokens, prefilled.status = prefilled.num_prompt_tokens, RequestStatus.FINISHED_LENGTH
    _, params = producer.request_finished(prefilled, [7, 8, 9, 10])
    params = {**params, "do_remote_prefill": True, "remote_port": 5555}
    assert params["remote_block_hash"] == prefilled.block_hashes[2].hex()
    assert params["remote_incarnation"] == "inc-me" and len(params["remote_lease_token"]) == 64

    consumer = scheduler("kv_consumer")
    same = request(3 * BS + 2, params, req_id="same")
    assert consumer.get_num_new_matched_tokens(same, 0) == (3 * BS, True)

    other = Request("other", list(range(100, 100 + 3 * BS + 2)), SamplingParams(), BS, params)
    assert consumer.get_num_new_matched_tokens(other, 0) == (0, True)
    consumer.update_state_after_alloc(other, [0, 1, 2, 3], 0)
    job = consumer.build_connector_meta(SchedulerOutput()).recvs["other"]
    assert job.local_block_ids == () and job.remote_request_id == prefilled.request_id  # only the release
    assert consumer.get_stats()["num_mismatched_params"] == 1


def test_decode_with_everything_cached_still_releases_the_prefill_blocks():
    sched = scheduler("kv_consumer")
    req = request(2 * BS, remote_params([7, 8]))
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (0, True)
    sched.update_state_after_alloc(req, [0, 1], 0)
    job = sched.build_connector_meta(SchedulerOutput()).recvs["r1"]
    assert job.local_block_ids == () and job.remote_block_ids == ()


def test_decode_request_that_ends_before_admission_releases_the_prefill_blocks():
    """Aborted (or refused by the engine) while waiting: its read never starts, its lease goes back now."""
    sched = scheduler("kv_consumer")
    req = request(2 * BS, remote_params([7, 8]))
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, []) == (False, None)
    job = sched.build_connector_meta(SchedulerOutput()).recvs["r1"]
    assert job.local_block_ids == () and job.lease.req_id == "pre-r1" and job.lease.token == "t" * 64
    assert sched.build_connector_meta(SchedulerOutput()).recvs == {}  # once
    read = request(2 * BS, remote_params([7, 8]), req_id="r2")  # admitted and read: released by its read only
    sched.get_num_new_matched_tokens(read, 0)
    sched.update_state_after_alloc(read, [0, 1], 2 * BS)
    sched.build_connector_meta(SchedulerOutput())
    read.status = RequestStatus.FINISHED_LENGTH
    sched.request_finished(read, [0, 1])
    assert sched.build_connector_meta(SchedulerOutput()).recvs == {}


def test_malformed_params_compute_locally_instead_of_crashing_the_step():
    sched = scheduler("kv_consumer")
    req = request(40, {**remote_params([1]), "remote_port": "nope"})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_prefill_holds_full_prompt_blocks_under_a_lease_and_reports_its_port():
    sched = scheduler("kv_producer")
    sched.update_connector_output(KVConnectorOutput(stats={SIDE_CHANNEL_PORT_STAT: 4242}))
    req = request(3 * BS + 5, {"do_remote_decode": True})
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH
    delay, params = sched.request_finished(req, [4, 5, 6, 7])
    assert delay and params["remote_block_ids"] == [4, 5, 6] and params["remote_port"] == 4242
    assert params["remote_engine_id"] == "me" and params["remote_num_tokens"] == 3 * BS
    assert sched.has_pending_transfers()
    lease = sched.build_connector_meta(SchedulerOutput()).leases["r1"]
    assert lease == LeaseRef(req_id="r1", token=params["remote_lease_token"], block_ids=[4, 5, 6],
                             block_hash=params["remote_block_hash"])  # fmt: skip
    sched.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert not sched.has_pending_transfers()
    other = request(3 * BS + 5, {"do_remote_decode": True}, req_id="r2")
    other.num_computed_tokens, other.status = other.num_prompt_tokens, RequestStatus.FINISHED_LENGTH
    assert sched.request_finished(other, [4, 5, 6, 7])[1]["remote_lease_token"] != params["remote_lease_token"]


def test_prefill_shorter_than_a_block_holds_nothing_and_the_decode_computes_it():
    sched = scheduler("kv_producer")
    req = request(BS - 1, {"do_remote_decode": True})
    req.num_computed_tokens, req.status = req.num_prompt_tokens, RequestStatus.FINISHED_LENGTH
    delay, params = sched.request_finished(req, [4])
    assert not delay and params["remote_block_ids"] == [] and not params["remote_lease_token"]
    assert not sched.has_pending_transfers()
    consumer = scheduler("kv_consumer")
    short = request(BS - 1, {**params, "do_remote_prefill": True}, req_id="short")
    assert consumer.get_num_new_matched_tokens(short, 0) == (0, False)  # nothing to read, nothing to prove


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_prefill_frees_aborted_requests_at_once(status):
    sched = scheduler("kv_producer")
    req = request(3 * BS, {"do_remote_decode": True})
    req.status = status
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)


def lease(req_id: str, token: str = "t" * 64, block_ids=(1,), block_hash: str = "h1") -> LeaseRef:
    return LeaseRef(req_id=req_id, token=token, block_ids=list(block_ids), block_hash=block_hash)


def test_lease_table_release_expiry_and_early_release():
    leases = LeaseTable(lease_s=10, incarnation="inc")
    leases.grant(lease("a"), now=0)
    leases.grant(lease("b", block_ids=(2,)), now=0)
    assert leases.renew("inc", [lease("b", block_ids=(2,))], now=8) == (["b"], [], [], {})
    assert leases.release("inc", [lease("a")], now=9) == (["a"], [], [], {})
    assert leases.collect(now=12) == {"a"}  # b was renewed until 18
    assert leases.pending(now=12) == {"b"}
    assert leases.pending(now=18) == set()  # overdue: nothing to wait for, even before collect
    assert leases.collect(now=18) == {"b"}
    assert leases.release("inc", [lease("b", block_ids=(2,))], now=19) == ([], [], ["b"], {})  # a late reader's read is void
    assert leases.renew("inc", [lease("b", block_ids=(2,))], now=19) == ([], [], ["b"], {})
    assert leases.release("inc", [lease("a")], now=19) == ([], [], ["a"], {})  # released once, never again
    # A release before the grant: "pending" (the blocks are still allocated); after the grant it matches.
    assert leases.release("inc", [lease("c")], now=20) == ([], ["c"], [], {})
    leases.grant(lease("c"), now=20)
    assert leases.release("inc", [lease("c")], now=20) == (["c"], [], [], {})
    assert leases.collect(now=20) == {"c"}
    assert leases.num_expired == 1 and len(leases) == 0


def test_lease_table_acts_only_on_an_exact_match():
    leases = LeaseTable(lease_s=10, incarnation="inc")
    real = lease("victim", token="s" * 64, block_ids=(4, 5), block_hash="h5")
    leases.grant(real, now=0)
    forgeries = [
        lease("victim"),  # the id alone (what version 1 of the protocol trusted)
        lease("victim", token="s" * 63 + "x", block_ids=(4, 5), block_hash="h5"),  # a guessed token
        lease("victim", token="s" * 64, block_ids=(4, 6), block_hash="h5"),  # other blocks
        lease("victim", token="s" * 64, block_ids=(4, 5), block_hash="h6"),  # another prompt's hash
    ]
    # A forgery is answered as an id never granted is ("pending"): no oracle of which ids are live.
    never_granted = lease("nobody", token="s" * 64)
    assert leases.renew("inc", [never_granted], now=1) == ([], ["nobody"], [], {})
    for forged in forgeries:
        assert leases.renew("inc", [forged], now=1) == ([], ["victim"], [], {})
        assert leases.release("inc", [forged], now=1) == ([], ["victim"], [], {})
    assert leases.release("inc-of-a-restarted-engine", [real], now=1) == ([], [], ["victim"], {})
    assert leases.num_refused == 2 * len(forgeries) + 1  # the prefill still counts the probes
    assert leases.pending(now=1) == {"victim"} and leases.collect(now=1) == set()  # still held
    assert leases.release("inc", [real], now=2) == (["victim"], [], [], {})
    assert leases.collect(now=2) == {"victim"}
    # Ended: its requester learns it ended ("unknown"); a forgery still learns nothing.
    assert leases.release("inc", [real], now=3) == ([], [], ["victim"], {})
    for forged in forgeries:
        assert leases.release("inc", [forged], now=3) == ([], ["victim"], [], {})


def test_a_lease_abandoned_before_its_grant_ends_at_the_grant():
    """A decode node that refuses a request at once (vLLM's 404 for an unknown model) or a proxy whose
    decode leg failed fast sends the abandon once, before the prefill engine's next step granted
    the lease: it is answered "pending" as always, and the grant that matches it ends the lease, so
    the blocks do not wait out the whole term."""
    leases = LeaseTable(lease_s=60, incarnation="inc")
    real = lease("r", token="s" * 64, block_ids=(4, 5), block_hash="h5")
    assert leases.release("inc", [], now=0, abandoned=[real]) == ([], ["r"], [], {})  # nothing to tell apart
    leases.grant(real, now=0.01)
    assert leases.collect(now=0.01) == {"r"} and len(leases) == 0
    assert leases.num_abandoned_before_grant == 1 and leases.num_expired == 0
    # The abandoner asks again (a proxy does, on "pending"): it hears "released". A read's confirmation
    # of the same lease is still refused: nothing was held for a read.
    assert leases.release("inc", [], now=0.02, abandoned=[real]) == (["r"], [], [], {})
    assert leases.release("inc", [real], now=0.02) == ([], [], ["r"], {})

    # Only the exact lease counts: a forged abandon (another token, blocks or hash) leaves the grant held.
    victim = lease("v", token="s" * 64, block_ids=(6,), block_hash="h6")
    forgeries = [
        lease("v", token="x" * 64, block_ids=(6,), block_hash="h6"),
        lease("v", token="s" * 64, block_ids=(7,), block_hash="h6"),
        lease("v", token="s" * 64, block_ids=(6,), block_hash="h7"),
    ]
    leases.release("inc", [], now=1, abandoned=forgeries)
    leases.release("inc-of-another-instance", [], now=1, abandoned=[victim])
    leases.grant(victim, now=1)
    assert leases.collect(now=1) == set() and leases.pending(now=1) == {"v"}

    # A confirmation before the grant is not remembered: the reader asks again and must get "released".
    read = lease("c", block_ids=(8,))
    assert leases.release("inc", [read], now=2) == ([], ["c"], [], {})
    leases.grant(read, now=2)
    assert leases.collect(now=2) == set()
    assert leases.release("inc", [read], now=2) == (["c"], [], [], {})

    # Remembered for EARLY_ABANDON_S only: a grant after that holds the blocks (they expire as before).
    late = lease("late", block_ids=(9,))
    leases.release("inc", [], now=3, abandoned=[late])
    leases.grant(late, now=3 + EARLY_ABANDON_S)
    assert "late" in leases.pending(now=3 + EARLY_ABANDON_S)
    # An abandon of a lease that expired is "unknown": its blocks were held to the end of the term.
    assert leases.collect(now=4 + 2 * EARLY_ABANDON_S + 60) >= {"late"}
    assert leases.release("inc", [], now=4 + 2 * EARLY_ABANDON_S + 60, abandoned=[late]) == ([], [], ["late"], {})


def test_early_abandons_are_bounded_and_need_every_tensor_parallel_rank():
    leases = LeaseTable(lease_s=60, incarnation="inc")
    first = lease("first", block_ids=(1,))
    leases.release("inc", [], now=0, abandoned=[first])
    flood = [lease(f"made-up-{i}", block_ids=(i,)) for i in range(MAX_EARLY_ABANDONS)]
    leases.release("inc", [], now=0, abandoned=flood)
    assert len(leases._abandoned_early) == MAX_EARLY_ABANDONS  # bounded: the oldest went first
    leases.grant(first, now=0)
    assert leases.collect(now=0) == set()  # pushed out by the flood: held until released or expired

    # A reader node of 2 ranks: the lease ends once both gave up on it, before or after the grant.
    two = lease("two", block_ids=(2,))
    leases.release("inc", [], now=1, reader_rank=0, num_readers=2, abandoned=[two])
    leases.grant(two, now=1)
    assert leases.collect(now=1) == set()
    assert leases.release("inc", [], now=1, reader_rank=1, num_readers=2, abandoned=[two]).matched == ["two"]
    assert leases.collect(now=1) == {"two"}


def test_lease_table_returns_the_digest_granted_with_a_lease_on_release():
    leases = LeaseTable(lease_s=10, incarnation="inc")
    digest = KVDigest(alg="xxh3-64", values=[1, 2**64 - 1])
    leases.grant(lease("a", block_ids=(4, 5)), now=0, digest=digest)
    leases.grant(lease("b", block_ids=(6,)), now=0)  # granted with verification off: no digest
    assert leases.renew("inc", [lease("a", block_ids=(4, 5))], now=1).digests == {}  # only a release carries it
    answer = leases.release("inc", [lease("a", block_ids=(4, 5)), lease("b", block_ids=(6,))], now=2)
    assert answer.matched == ["a", "b"] and answer.digests == {"a": digest}


def test_throughput_counts_wall_time_with_transfers_in_flight():
    assert busy_seconds(np.array([0.0, 5.0, 20.0]), np.array([10.0, 6.0, 21.0])) == 11.0
    stats = TransferStats()
    for start in range(8):  # eight overlapping one-second transfers of 1 GB each
        stats.record_done(start * 0.01, start * 0.01 + 1.0, 10**9, 1)
    d = stats.as_dict()
    assert d["bytes_transferred"] == 8 * 10**9
    assert d["throughput_gbps"] == pytest.approx(8 / 1.07)
    assert d["latency_ms_p50"] == pytest.approx(1000.0)
    assert d["device_read_gbps"] == 0.0  # none timed on a device


def test_device_timed_reads_and_grants_are_reported_apart_from_wall_time():
    stats = TransferStats()
    stats.record_done(0.0, 0.010, 10**9, 4, device_s=0.002)  # 10 ms posted-to-seen, 2 ms of copying
    stats.record_done(1.0, 1.010, 10**9, 4, device_s=0.004)
    stats.record_done(2.0, 2.010, 10**9, 4)  # a NIXL read: no device time
    stats.record_grant(0.0005)
    d = stats.as_dict()
    assert d["device_read_ms_p50"] == pytest.approx(3.0)
    assert d["device_read_gbps"] == pytest.approx(2 / 0.006)
    assert d["latency_ms_p50"] == pytest.approx(10.0)
    assert d["grant_ms_p50"] == pytest.approx(0.5)


def test_only_a_step_granting_leases_asks_tensor_parallel_ranks_for_a_report():
    """Ranks > 0 report only the digests of leases granted that step; a driver exchanging by collective
    (the vLLM adapter) skips every other step's exchange on all ranks, so the answer must hold for each."""
    from kvbridge.connectors.base import ConnectorContext, KVConnectorRole
    from kvbridge.connectors.nixl.connector import NixlConnector
    from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata

    config = KVTransferConfig(connector="NixlConnector", role="kv_both")
    connector = NixlConnector(config, KVConnectorRole.SCHEDULER, ConnectorContext(model_id="m", block_size=BS, device="cpu"))
    lease = LeaseRef(req_id="r1", token="ab" * 32, block_ids=[0, 1], block_hash="cd" * 32)
    assert connector.has_tp_step_report(NixlConnectorMetadata(leases={"r1": lease}))
    assert not connector.has_tp_step_report(NixlConnectorMetadata())
    assert not connector.has_tp_step_report(None)
