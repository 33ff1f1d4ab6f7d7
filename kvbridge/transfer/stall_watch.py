"""`StallWatch`: notices when this process stops running, and says so in its log and gauges.

A transfer's peer only sees a stalled process as silence: a side channel that does not answer, a
NIXL read that is never reported done (a first read waits for the owner's UCX worker to answer the
new connection, endpoint.py). Whether the owner was slow or frozen is then a guess. A thread that
should wake every `period_s` and wakes `threshold_s` or more late is evidence that for that long this
process's Python threads did not run: the process was not scheduled (an overloaded host, a memory or
I/O stall), it was stopped (SIGSTOP, a debugger), or one thread held the GIL in a long call. The
warning names the span in wall-clock time, to be matched with a peer's expired read or handshake
timeout.

    watch = StallWatch("prefill engine e1").start()
    ...   watch.num_stalls, watch.max_stall_s   (gauges)
    watch.stop()
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

PERIOD_S = 0.1
THRESHOLD_S = 1.0


class StallWatch:
    def __init__(self, name: str, *, period_s: float = PERIOD_S, threshold_s: float = THRESHOLD_S) -> None:
        if not 0 < period_s < threshold_s:
            raise ValueError(f"StallWatch needs 0 < period_s < threshold_s, got {period_s} and {threshold_s}")
        self.name = name
        self.period_s, self.threshold_s = period_s, threshold_s
        self.num_stalls = 0
        self.max_stall_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbridge-stall-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Idempotent; returns once the thread ended (at most one period)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        due = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            late_s = now - due
            if late_s >= self.threshold_s:
                self._record(late_s)
            due = now + self.period_s

    def _record(self, late_s: float) -> None:
        self.num_stalls += 1
        self.max_stall_s = max(self.max_stall_s, late_s)
        end = time.time()
        logger.warning(
            "%s: this process did not run for %.1f s (%s to %s): its side-channel answers waited as long, so a peer "
            "may have timed out on it; an overloaded host, a stopped process, a memory or I/O stall, or a thread "
            "holding Python's GIL in one long call can cause this", self.name, late_s, _clock_time(end - late_s),
            _clock_time(end),
        )  # fmt: skip


def _clock_time(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
