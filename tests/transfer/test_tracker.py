"""Transfer records: state machine, deadlines and expiry, with a fake clock."""

from __future__ import annotations

import pytest

from kvbridge.transfer.tracker import IllegalTransitionError, TransferState, TransferTracker

S = TransferState


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


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
