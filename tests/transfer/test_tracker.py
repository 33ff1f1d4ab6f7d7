"""Transfer records: state machine, deadlines, expiry and flush, with a fake clock."""

from __future__ import annotations

import pytest

from kvbridge.transfer.tracker import IllegalTransitionError, TransferState, TransferTracker

S = TransferState


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, dt):
        self.now += dt


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tracker(clock):
    return TransferTracker(clock)


def test_happy_path_and_counters(tracker, clock):
    rec = tracker.start("r1", "tcp://p:1", timeout_s=5.0)
    assert rec.state is S.HANDSHAKING and rec.deadline == 105.0
    clock.now = 101.0
    tracker.mark_posted("r1", 2.0, nbytes=4096, num_descriptors=2)
    assert rec.state is S.POSTED and rec.deadline == 103.0 and rec.nbytes == 4096
    tracker.mark_done("r1")
    assert rec.is_final and rec.is_ok and rec.finished_at == 101.0
    assert rec.history == [S.HANDSHAKING, S.POSTED, S.DONE]
    assert (tracker.num_done, tracker.bytes_done, tracker.num_failed) == (1, 4096, 0)
    assert tracker.pop_final() == [rec] and tracker.get("r1") is None


@pytest.mark.parametrize(
    "path",
    [
        [S.POSTED, S.POSTED],
        [S.DONE],  # HANDSHAKING -> DONE skips the post
        [S.POSTED, S.DONE, S.FAILED],
        [S.FAILED, S.POSTED],
        [S.POSTED, S.FAILED, S.DONE],
    ],
)
def test_illegal_transitions_raise(tracker, path):
    tracker.start("r", "p", 1.0)
    moves = {S.POSTED: lambda: tracker.mark_posted("r", 1.0), S.DONE: lambda: tracker.mark_done("r"),
             S.FAILED: lambda: tracker.mark_failed("r", "x")}
    with pytest.raises(IllegalTransitionError):
        for state in path:
            moves[state]()


def test_cannot_start_twice_while_live_but_may_restart_after_final(tracker):
    tracker.start("r", "p", 1.0)
    with pytest.raises(ValueError, match="already"):
        tracker.start("r", "p", 1.0)
    tracker.mark_failed("r", "gone")
    assert tracker.start("r", "p", 1.0).state is S.HANDSHAKING
    with pytest.raises(IllegalTransitionError):
        tracker.start("q", "p", 1.0, state=S.DONE)
    with pytest.raises(KeyError):
        tracker.mark_done("unknown")


def test_every_live_state_expires_at_its_deadline(tracker, clock):
    a = tracker.start("hs", "p", 1.0)
    b = tracker.start("posted", "p", 10.0, state=S.POSTED)
    assert tracker.expire_overdue(100.999) == []
    assert tracker.expire_overdue(101.0) == [a]
    assert a.state is S.EXPIRED and "HANDSHAKING" in a.error
    assert tracker.expire_overdue(110.0) == [b] and "POSTED" in b.error
    assert tracker.num_failed == 2 and tracker.num_live == 0
    assert tracker.expire_overdue(1e9) == []  # final records never change


def test_flush_completes_when_poll_finishes_everything(tracker, clock):
    tracker.start("a", "p", 50.0, state=S.POSTED)
    tracker.start("b", "p", 50.0, state=S.POSTED)
    calls = []

    def poll():
        calls.append(clock.now)
        if len(calls) == 3:
            tracker.mark_done("a")
        if len(calls) == 5:
            tracker.mark_failed("b", "peer died")

    out = tracker.flush(10.0, poll, sleep=clock.sleep, first_wait_s=0.5, max_wait_s=0.5)
    assert out.is_complete and out.pending_req_ids == frozenset() and out.num_failed == 1
    assert len(calls) == 5 and clock.now == 102.0
    assert {r.req_id for r in tracker.pop_final()} == {"a", "b"}


def test_flush_returns_pending_at_its_deadline(tracker, clock):
    tracker.start("stuck", "p", 60.0, state=S.POSTED)
    tracker.start("quick", "p", 60.0, state=S.POSTED)
    tracker.mark_done("quick")
    out = tracker.flush(2.0, lambda: None, sleep=clock.sleep, first_wait_s=0.25, max_wait_s=0.25)
    assert not out.is_complete and out.pending_req_ids == frozenset({"stuck"})
    assert 102.0 <= clock.now <= 102.25
    assert tracker.get("stuck").state is S.POSTED  # still live: the flush deadline is not the record's


def test_flush_longer_than_record_deadlines_always_completes(tracker, clock):
    tracker.start("stuck", "p", 1.0, state=S.POSTED)
    out = tracker.flush(5.0, lambda: None, sleep=clock.sleep, first_wait_s=0.1, max_wait_s=0.1)
    assert out.is_complete and out.num_failed == 1
    assert tracker.get("stuck").state is S.EXPIRED


def test_flush_with_nothing_live_returns_at_once(tracker, clock):
    polls = []
    out = tracker.flush(1.0, lambda: polls.append(1), sleep=clock.sleep)
    assert out.is_complete and polls == [1] and clock.now == 100.0
