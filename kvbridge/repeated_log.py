"""Warnings that repeat, aggregated: one dead node must not write a line per request.

    warnings = RepeatedWarnings(logger)
    warnings.warning("no_prefill_node", "no prefill node answered (%s): ...", exc)

Used by the proxy (a dead prefill node) and the engine (a peer that fails every request's load).

The first warning of a key is logged at once. Later ones within `window_s` of the last line logged
for that key are only counted; the next line logged after the window says how many were folded
into it: "... (and 46 more like it in the last 30 s)". Not thread-safe: one owner's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 30.0
MAX_KEYS = 1024  # keys are node URLs or reasons: a bound, never reached in practice


@dataclass
class _Seen:
    logged_at: float
    num_folded: int = 0


class RepeatedWarnings:
    """Logs the first warning of each key, then at most one per `window_s`, with a count of the rest."""

    def __init__(self, logger: logging.Logger, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self._logger, self._window_s, self._clock = logger, window_s, clock
        self._seen: dict[str, _Seen] = {}

    def warning(self, key: str, fmt: str, *args: object) -> bool:
        """Log (or count) one warning of `key`; True when a line was written."""
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.logged_at < self._window_s:
            seen.num_folded += 1
            return False
        if seen is not None and seen.num_folded:
            fmt += f" (and {seen.num_folded} more like it in the last {now - seen.logged_at:.0f} s)"
        if len(self._seen) >= MAX_KEYS and key not in self._seen:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = _Seen(now)
        self._logger.warning(fmt, *args)
        return True
