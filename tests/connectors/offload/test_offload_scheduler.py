"""The offload scheduler side alone (pure bookkeeping), driven like the engine drives it."""

from __future__ import annotations

from kvbridge.connectors.base import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from kvbridge.connectors.offload.config import OffloadConfig
from kvbridge.connectors.offload.scheduler import OffloadScheduler
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams

BS = 4


def _request(req_id: str, num_tokens: int = 13, first_token: int = 100) -> Request:
    tokens = list(range(first_token, first_token + num_tokens))
    return Request(req_id, tokens, SamplingParams(max_tokens=1), BS)


def _step(sched: OffloadScheduler, *scheduled: tuple[Request, int, int, list[int]], preempted=()):
    requests = [ScheduledRequest(r, s, n, b) for r, s, n, b in scheduled]
    output = SchedulerOutput(requests, preempted_req_ids=set(preempted))
    return sched.build_connector_meta(output)


def test_blocks_are_stored_once_and_visible_only_after_finished_sending():
    sched = OffloadScheduler(OffloadConfig(host_num_blocks=8), BS, None)
    req = _request("a")  # 13 tokens: 3 full blocks
    meta = _step(sched, (req, 0, 8, [5, 6, 7, 8]))
    assert [(j.gpu_block_ids, j.slots) for j in meta.stores] == [([5, 6], [0, 1])]
    meta = _step(sched, (req, 8, 5, [5, 6, 7, 8]))
    assert [(j.gpu_block_ids, j.slots) for j in meta.stores] == [([7], [2])]  # only the new full block
    other = _request("b")
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)  # STORING is invisible
    assert sched.request_finished(req, [5, 6, 7, 8]) == (True, None)
    assert sched.has_pending_transfers()
    sched.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert not sched.has_pending_transfers()
    assert sched.get_num_new_matched_tokens(other, 0) == (3 * BS, True)
    assert sched.get_num_new_matched_tokens(other, BS) == (2 * BS, True)  # beyond the local hit
    # 3 full blocks, all loaded: the engine computes the last token again (its progress is capped
    # at num_tokens - 1), one slot rather than the whole last block
    short = _request("c", 12)
    assert sched.get_num_new_matched_tokens(short, 0) == (3 * BS, True)
    # ... but the last block alone is not loaded: computing it costs no round trip
    assert sched.get_num_new_matched_tokens(short, 2 * BS) == (0, False)
    sched.check_integrity()


def _stored(sched: OffloadScheduler, req_id: str = "a") -> None:
    req = _request(req_id)
    _step(sched, (req, 0, 13, [1, 2, 3, 4]))
    sched.request_finished(req, [1, 2, 3, 4])
    sched.update_connector_output(KVConnectorOutput(finished_sending={req_id}))


def test_loads_pin_and_failed_blocks_leave_the_tier():
    sched = OffloadScheduler(OffloadConfig(host_num_blocks=3), BS, None)
    _stored(sched)
    req = _request("b")
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [9, 10, 11, 12], num)
    meta = _step(sched)
    assert [(j.gpu_block_ids, j.slots) for j in meta.loads] == [([9, 10, 11], [0, 1, 2])]
    assert sched.host.pin_counts() == {h: 1 for h in req.block_hashes}
    # The tier is full of pinned blocks: a new request's blocks cannot be stored now.
    meta = _step(sched, (_request("x", 9, first_token=7), 0, 8, [20, 21, 22]))
    assert meta.stores == [] and sched.get_stats()["stores_skipped_full_blocks"] == 2
    sched.check_integrity()
    sched.update_connector_output(KVConnectorOutput(finished_recving={"b"}, invalid_block_ids={10}))
    assert sched.host.pin_counts() == {}
    assert req.block_hashes[1] not in sched.host and sched.host.is_ready(req.block_hashes[0])
    assert sched.get_stats()["load_failed_blocks"] == 1
    sched.check_integrity()


def test_a_load_cancelled_before_reaching_the_worker_releases_its_pins():
    sched = OffloadScheduler(OffloadConfig(host_num_blocks=4), BS, None)
    _stored(sched)
    req = _request("b")
    num, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [9, 10, 11, 12], num)
    assert sched.request_finished(req, [9, 10, 11, 12]) == (False, None)
    assert sched.host.pin_counts() == {} and _step(sched).loads == []
    sched.check_integrity()


def test_preempted_requests_make_the_worker_wait_and_are_rescanned():
    sched = OffloadScheduler(OffloadConfig(host_num_blocks=8), BS, None)
    req = _request("a")
    _step(sched, (req, 0, 8, [1, 2]))
    meta = _step(sched, preempted={"a"})
    assert meta.wait_for_req_ids == {"a"}
    meta = _step(sched, (req, 0, 13, [3, 4, 5, 6]))  # recomputed: blocks 0-1 are already in the tier
    assert [j.gpu_block_ids for j in meta.stores] == [[5]]
    sched.check_integrity()
