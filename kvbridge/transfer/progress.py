"""Waiting without spinning: drive progress until a condition holds or a deadline passes.

Every loop in kvbridge that waits for something it cannot block on (NIXL transfer states, CUDA
events, a peer's reply, the engine's own bookkeeping) waits here, between two rounds, for
a bounded exponential backoff: the first wait is short (a transfer that is nearly done is seen
at once), later waits double up to a cap (a long wait costs a few wake-ups per millisecond at
most, not a core).

    done = drive_until(lambda: not pending(), deadline, progress=advance)   # True: condition holds

Work that ends on another thread (a side-channel answer on a helper thread, a copy on a copier
thread) need not wait for the next poll: the thread rings a `Wakeup`, and a waiter that sleeps in
`wakeup.wait` (pass it as drive_until's `sleep`) resumes at once.

Pure Python; the clock and the sleep are injectable (tests use a fake clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

FIRST_WAIT_S = 50e-6  # the first wait after a round that found nothing to do
MAX_WAIT_S = 2e-3  # the longest wait between two rounds: bounds how late a completion is seen


class Backoff:
    """Waits that double from `first_s` up to `max_s`; `reset()` (after progress) starts over."""

    def __init__(self, first_s: float = FIRST_WAIT_S, max_s: float = MAX_WAIT_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={first_s}, max_s={max_s}")
        self.first_s, self.max_s = first_s, max_s
        self._next_s = first_s

    def next_s(self) -> float:
        """The next wait; the one after it is twice as long (at most `max_s`)."""
        wait, self._next_s = self._next_s, min(2 * self._next_s, self.max_s)
        return wait

    def reset(self) -> None:
        self._next_s = self.first_s


def drive_until(
    condition: Callable[[], bool],
    deadline: float,
    *,
    progress: Callable[[], object] | None = None,
    first_wait_s: float = FIRST_WAIT_S,
    max_wait_s: float = MAX_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> bool:
    """Round after round: `progress()` (if given), then `condition()`; True as soon as it holds.

    False once `deadline` (a `clock()` time) passed without it holding. Between two rounds it
    sleeps for the next wait of a `Backoff(first_wait_s, max_wait_s)`, never past the deadline.
    The first round runs at once, even with the deadline already past.
    """
    backoff = Backoff(first_wait_s, max_wait_s)
    while True:
        if progress is not None:
            progress()
        if condition():
            return True
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(backoff.next_s(), left))


class Wakeup:
    """A doorbell between the threads that finish work and the one thread that waits for it.

    `ring()` is safe from any thread and cheap; it sets a flag and calls the subscribers (e.g. a
    server loop that waits on a condition variable of its own). `wait(timeout_s)` sleeps until a
    ring or the timeout and consumes the ring: a ring that arrives while nobody waits makes the
    next wait return at once, so none is lost between a poll and the wait after it.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._subscribers: list[Callable[[], object]] = []

    def ring(self) -> None:
        self._event.set()
        for subscriber in self._subscribers:
            subscriber()

    def wait(self, timeout_s: float) -> bool:
        """True when rung (now or since the last wait), False at the timeout."""
        rung = self._event.wait(timeout_s)
        self._event.clear()
        return rung

    def subscribe(self, subscriber: Callable[[], object]) -> None:
        """Call `subscriber()` on every ring, on the ringing thread; it must be quick and not block."""
        self._subscribers.append(subscriber)

    def close(self) -> None:
        """Forget the subscribers (the owner shuts down): no reference cycle outlives it."""
        self._subscribers = []
