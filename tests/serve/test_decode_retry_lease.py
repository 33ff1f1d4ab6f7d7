"""What the proxy's decode retry relies on (docs/pd-disaggregation.md, "Failure model of the proxy"):
a prefill lease is not bound to its first reader. A second decode node with the same params is
vouched for while the prefill still holds the blocks, and refused ("unknown", so it recomputes)
once the blocks may have been freed; a reader that dies strands nothing."""

from __future__ import annotations

from kvbridge.connectors.nixl.leases import LeaseTable
from kvbridge.transfer.messages import LeaseRef

INCARNATION = "prefill-instance"
LEASE_S = 30.0


def _lease(req_id: str) -> LeaseRef:
    return LeaseRef(req_id=req_id, token=f"token-of-{req_id}", block_ids=[3, 4], block_hash="ab" * 16)


def test_a_second_reader_is_vouched_for_after_the_first_died_mid_read():
    table = LeaseTable(LEASE_S, INCARNATION)
    lease = _lease("r")
    table.grant(lease, now=0.0)
    assert table.renew(INCARNATION, [lease], now=5.0).matched == ["r"]  # the first reader, reading; then it dies
    assert table.collect(now=6.0) == set()  # still held: nobody released it
    assert table.release(INCARNATION, [lease], now=9.0).matched == ["r"]  # the retry's reader confirms
    assert table.collect(now=10.0) == {"r"}  # and the blocks are freed now, not at expiry


def test_a_second_reader_after_the_blocks_were_freed_is_refused_and_recomputes():
    table = LeaseTable(LEASE_S, INCARNATION)
    lease = _lease("r")
    table.grant(lease, now=0.0)
    assert table.release(INCARNATION, [lease], now=1.0).matched == ["r"]  # the first reader confirmed, then died
    # Until the engine frees the blocks they are still held: a read confirmed now was a read of them.
    assert table.release(INCARNATION, [lease], now=1.5).matched == ["r"]
    assert table.collect(now=2.0) == {"r"}  # freed: they may be reused from here on
    answer = table.release(INCARNATION, [lease], now=3.0)
    assert answer.matched == [] and answer.unknown == ["r"]  # a load error: the second reader recomputes


def test_a_reader_that_dies_strands_nothing():
    table = LeaseTable(LEASE_S, INCARNATION)
    table.grant(_lease("r"), now=0.0)
    assert table.collect(now=LEASE_S - 1) == set()
    assert table.collect(now=LEASE_S) == {"r"} and table.num_expired == 1
