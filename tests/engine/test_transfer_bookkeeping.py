"""TransferBookkeeping on its own: it decides what the scheduler must do and never acts on it."""

from __future__ import annotations

from sched_fakes import make_request

from kvbridge.connectors.base import KVConnectorOutput
from kvbridge.engine.request import RequestStatus
from kvbridge.engine.transfer_bookkeeping import TransferBookkeeping

BS = 4


def parked(book: TransferBookkeeping, request_id: str, num_tokens_loading: int):
    request = make_request(request_id, list(range(10, 30)), block_size=BS)
    book.park(request, num_tokens_loading)
    return request


def test_a_finished_load_resumes_the_request_with_the_tokens_it_loaded():
    book = TransferBookkeeping(None, BS, "recompute")
    request = parked(book, "a", 16)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and book.pending_req_ids() == {"a"}
    actions = book.finished_transfers(KVConnectorOutput(finished_recving={"a"}), live_req_ids={"a"})
    assert actions.resume == [(request, 16)] and actions.free == []
    assert not book.has_pending_transfers()


def test_a_load_error_decides_a_roll_back_and_caps_the_parked_load():
    book = TransferBookkeeping(None, BS, "recompute")
    request = parked(book, "a", 16)
    actions = book.receive_report(KVConnectorOutput(invalid_block_ids={7}), {"a": [5, 6, 7, 8], "b": [1, 2]})
    assert actions.uncache_blocks == {7} and actions.first_bad_block == {"a": 2}
    assert actions.roll_back == {"a": 8} and actions.fail == {}
    resumed = book.finished_transfers(KVConnectorOutput(finished_recving={"a"}), live_req_ids={"a"})
    assert resumed.resume == [(request, 8)]  # the load counts up to the first bad block only


def test_the_fail_policy_names_the_error_instead():
    book = TransferBookkeeping(None, BS, "fail")
    actions = book.receive_report(KVConnectorOutput(invalid_block_ids={2}), {"a": [1, 2]})
    assert actions.roll_back == {} and "load_failure_policy is 'fail'" in actions.fail["a"]


def test_a_request_finished_while_loading_keeps_its_blocks_until_the_load_ends():
    book = TransferBookkeeping(None, BS, "recompute")
    request = parked(book, "a", 16)
    request.status = RequestStatus.FINISHED_ABORTED
    finished = book.request_finished(request, [5, 6, 7, 8])
    assert finished.free_blocks is False and book.block_owners() == {"a"}
    actions = book.finished_transfers(KVConnectorOutput(finished_recving={"a"}), live_req_ids=set())
    assert actions.free == ["a"] and actions.resume == [] and book.block_owners() == set()
