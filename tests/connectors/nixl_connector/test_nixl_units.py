"""NixlConnector bookkeeping without NIXL: params, options, the scheduler half, leases, metrics."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.nixl.leases import LeaseTable
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.params import parse_remote_prefill
from kvbridge.connectors.nixl.scheduler import SIDE_CHANNEL_PORT_STAT, NixlScheduler
from kvbridge.connectors.nixl.stats import TransferStats, busy_seconds
from kvbridge.engine.outputs import KVConnectorOutput, SchedulerOutput
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import ConfigError, InvalidRequestError

BS = 16


def remote_params(block_ids, port=5555) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "pre",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": list(block_ids),
        "remote_request_id": "pre-r1",
    }


def request(num_tokens: int, params: dict | None = None, req_id: str = "r1") -> Request:
    return Request(req_id, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4), BS, params)


def scheduler(role: str) -> NixlScheduler:
    return NixlScheduler(KVTransferConfig("NixlConnector", role=role, engine_id="me", side_channel_port=0), BS, 30.0)


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


def test_decode_asks_only_for_blocks_missing_locally_and_plans_one_read():
    sched = scheduler("kv_consumer")
    req = request(5 * BS + 3, remote_params([10, 11, 12, 13, 14]))
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, True)
    sched.update_state_after_alloc(req, [0, 1, 2, 3, 4, 5], 3 * BS)
    meta = sched.build_connector_meta(SchedulerOutput())
    job = meta.recvs["r1"]
    assert job.local_block_ids == (2, 3, 4) and job.remote_block_ids == (12, 13, 14)
    assert job.remote.address == "tcp://127.0.0.1:5555" and job.remote_request_id == "pre-r1"
    # asked once: a re-admission (after preemption) computes locally
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_connector_meta(SchedulerOutput()).recvs == {}


def test_remote_blocks_of_another_prompt_are_never_read():
    producer = scheduler("kv_producer")
    prefilled = request(3 * BS + 2, {"do_remote_decode": True})
    prefilled.num_computed_tokens, prefilled.status = prefilled.num_prompt_tokens, RequestStatus.FINISHED_LENGTH
    _, params = producer.request_finished(prefilled, [7, 8, 9, 10])
    params = {**params, "do_remote_prefill": True, "remote_port": 5555}
    assert params["remote_block_hash"] == prefilled.block_hashes[2].hex()

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
    assert sched.build_connector_meta(SchedulerOutput()).leases == {"r1": (4, 5, 6)}
    sched.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert not sched.has_pending_transfers()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_prefill_frees_aborted_requests_at_once(status):
    sched = scheduler("kv_producer")
    req = request(3 * BS, {"do_remote_decode": True})
    req.status = status
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)


def test_lease_table_release_expiry_and_early_release():
    leases = LeaseTable(lease_s=10)
    leases.grant("a", (1,), now=0)
    leases.grant("b", (2,), now=0)
    assert leases.renew(["b"], now=8) == (["b"], [])
    assert leases.release(["a"]) == (["a"], [])
    assert leases.collect(now=12) == {"a"}  # b was renewed until 18
    assert leases.pending() == {"b"}
    assert leases.collect(now=18) == {"b"}
    assert leases.release(["b"]) == ([], ["b"])  # a late reader is told its read is void
    assert leases.renew(["b"], now=19) == ([], ["b"])
    # TransferDone before the grant: the blocks were never freed, the read is valid
    assert leases.release(["c"]) == (["c"], [])
    leases.grant("c", (3,), now=20)
    assert leases.pending() == set() and leases.collect(now=20) == {"c"}
    assert leases.num_expired == 1 and len(leases) == 0


def test_throughput_counts_wall_time_with_transfers_in_flight():
    assert busy_seconds(np.array([0.0, 5.0, 20.0]), np.array([10.0, 6.0, 21.0])) == 11.0
    stats = TransferStats()
    for start in range(8):  # eight overlapping one-second transfers of 1 GB each
        stats.record_done(start * 0.01, start * 0.01 + 1.0, 10**9, 1)
    d = stats.as_dict()
    assert d["bytes_transferred"] == 8 * 10**9
    assert d["throughput_gbps"] == pytest.approx(8 / 1.07)
    assert d["latency_ms_p50"] == pytest.approx(1000.0)
