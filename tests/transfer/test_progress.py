"""drive_until and Backoff: condition, deadline, backoff, with a fake clock; Wakeup across threads."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.transfer.progress import Backoff, Wakeup, drive_until


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self):
        return self.now

    def sleep(self, dt):
        self.sleeps.append(dt)
        self.now += dt


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_reset():
    backoff = Backoff(first_s=1.0, max_s=5.0)
    assert [backoff.next_s() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next_s() == 1.0


@pytest.mark.parametrize("first_s, max_s", [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_backoff_refuses_waits_that_cannot_back_off(first_s, max_s):
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s, max_s)


def test_a_condition_that_holds_returns_at_once_after_one_round():
    clock, rounds = FakeClock(), []
    assert drive_until(lambda: True, 10.0, progress=lambda: rounds.append(clock.now), clock=clock, sleep=clock.sleep)
    assert rounds == [0.0] and clock.sleeps == []


def test_progress_runs_each_round_until_the_condition_holds_with_backoff_between():
    clock, rounds = FakeClock(), []
    done = drive_until(
        lambda: len(rounds) == 6, 100.0, progress=lambda: rounds.append(clock.now),
        first_wait_s=1.0, max_wait_s=4.0, clock=clock, sleep=clock.sleep,
    )  # fmt: skip
    assert done and len(rounds) == 6
    assert clock.sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]  # doubling, capped; none after the last round


def test_the_deadline_ends_it_without_sleeping_past_it():
    clock = FakeClock()
    conditions = []

    def condition():
        conditions.append(clock.now)
        return False

    assert not drive_until(condition, 10.0, first_wait_s=1.0, max_wait_s=4.0, clock=clock, sleep=clock.sleep)
    assert clock.now == 10.0 and clock.sleeps == [1.0, 2.0, 4.0, 3.0]  # the last wait is cut at the deadline
    assert conditions[-1] == 10.0  # the condition is asked once more at the deadline


def test_a_past_deadline_still_gets_one_round():
    clock = FakeClock()
    clock.now = 50.0
    assert drive_until(lambda: True, 10.0, clock=clock, sleep=clock.sleep)
    assert not drive_until(lambda: False, 10.0, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []


def test_a_ring_from_another_thread_ends_the_wait_at_once():
    wakeup, woke = Wakeup(), []
    waiter = threading.Thread(target=lambda: woke.append((wakeup.wait(30.0), time.monotonic())))
    waiter.start()
    time.sleep(0.05)
    rung_at = time.monotonic()
    wakeup.ring()
    waiter.join(5.0)
    assert woke and woke[0][0] is True
    assert woke[0][1] - rung_at < 1.0  # not the 30 s timeout


def test_a_ring_while_nobody_waits_is_kept_for_the_next_wait_only():
    wakeup = Wakeup()
    wakeup.ring()
    assert wakeup.wait(10.0) is True  # returns at once: the ring was not lost between two waits
    assert wakeup.wait(0.01) is False  # consumed


def test_subscribers_hear_every_ring():
    wakeup, heard = Wakeup(), []
    wakeup.subscribe(lambda: heard.append(1))
    wakeup.ring()
    wakeup.ring()
    assert heard == [1, 1]


def test_a_closed_wakeup_calls_no_subscriber():
    wakeup, heard = Wakeup(), []
    wakeup.subscribe(lambda: heard.append(1))
    wakeup.close()
    wakeup.ring()
    assert heard == [] and wakeup.wait(0.0)  # the ring itself still wakes a waiter
