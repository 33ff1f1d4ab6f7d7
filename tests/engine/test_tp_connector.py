"""How rank 0 merges its connector half's answers with the other ranks' (engine/tp_connector.py), and
how the prefill's lease table counts the confirmations of a tensor-parallel reader node. No processes."""

from __future__ import annotations

import msgspec

from kvbridge.connectors.base import KVConnectorOutput
from kvbridge.connectors.nixl.leases import LeaseTable
from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata, RecvJob, RemoteEngine
from kvbridge.engine.tp_connector import RankDriver, RankOutput
from kvbridge.transfer.messages import LeaseRef


def rank(sending=(), recving=(), invalid=(), errors=None) -> RankOutput:
    return RankOutput(sorted(sending), sorted(recving), sorted(invalid), errors or {}, b"")


def driver() -> RankDriver:
    return RankDriver(group=None, connector=None)  # merge touches neither


def test_a_request_is_finished_only_once_every_rank_finished_it():
    d = driver()
    out = d.merge(KVConnectorOutput(finished_recving={"a", "b"}, finished_sending={"p"}), [rank(recving={"a"})])
    assert out.finished_recving == {"a"} and out.finished_sending == set()
    out = d.merge(KVConnectorOutput(), [rank(recving={"b"}, sending={"p"})])
    assert out.finished_recving == {"b"} and out.finished_sending == {"p"}
    assert d.merge(KVConnectorOutput(), [rank()]).finished_recving == set()  # reported once


def test_a_load_error_on_any_rank_fails_the_request_when_every_rank_is_done_with_it():
    d = driver()
    # rank 1 failed (its blocks 4, 5), rank 0 still reads: nothing yet, the blocks are not reported early
    out = d.merge(KVConnectorOutput(), [rank(recving={"a"}, invalid={4, 5}, errors={"a": "digest mismatch"})])
    assert out.finished_recving == set() and out.invalid_block_ids == set() and out.load_errors == {}
    out = d.merge(KVConnectorOutput(finished_recving={"a"}), [rank()])
    assert out.finished_recving == {"a"} and out.invalid_block_ids == {4, 5}
    assert out.load_errors == {"a": "tensor-parallel rank 1: digest mismatch"}


def test_connector_metadata_crosses_to_the_other_ranks_as_msgspec_not_pickle():
    from kvbridge.connectors.nixl.connector import NixlConnector

    lease = LeaseRef(req_id="r", token="t", block_ids=[3, 4], block_hash="ab")
    meta = NixlConnectorMetadata(
        recvs={"d": RecvJob("d", RemoteEngine("p", "127.0.0.1", 5600, "inc"), lease, (7, 8), (3, 4), 0, 2.0)},
        leases={"r": lease},
    )
    data = msgspec.msgpack.encode(meta)
    assert msgspec.msgpack.decode(data, type=NixlConnector.metadata_type) == meta


def test_a_lease_read_by_a_tp_reader_node_is_released_once_every_reader_rank_confirmed():
    table = LeaseTable(lease_s=30.0, incarnation="inc")
    lease = LeaseRef(req_id="r", token="t", block_ids=[1, 2], block_hash="ab")
    table.grant(lease, now=0.0)
    first = table.release("inc", [lease], 1.0, reader_rank=1, num_readers=2)
    assert first.matched == ["r"] and table.collect(1.0) == set()  # rank 0 may still be reading
    assert table.release("inc", [lease], 1.5, reader_rank=1, num_readers=2).matched == ["r"]  # a repeat counts once
    assert table.collect(1.5) == set()
    assert table.release("inc", [lease], 2.0, reader_rank=0, num_readers=2).matched == ["r"]
    assert table.collect(2.0) == {"r"}
