"""Runs of adjacent block ids: the one place kvbridge finds them.

Moving KV costs per run, not per block: a NIXL descriptor, a CUDA IPC copy, a memcpy or a DMA of
the offload copier each move one run of blocks that are adjacent in memory. So the block pool
hands out contiguous runs where it can, and every mover coalesces what it is given:

- `run_starts(a, b, step)`: where runs adjacent on both sides of a pairing begin (numpy; also for
  byte offsets, with `step` the unit's size): transfer descriptors and CUDA IPC copies;
- `paired_runs(src, dst)`: the same pairing as (src start, dst start, length) runs: the offload
  copier's memcpys;
- `capped_runs(ids, max_len)`: runs of one side, at most `max_len` long: the offload copier's DMAs
  through a staging buffer;
- `find_run(sorted_free, n, prefer_start)`: a run of `n` free ids: the block pool's allocation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

Run = tuple[int, int, int]  # (src_start, dst_start, num_blocks)


def run_starts(first, second=None, step: int = 1) -> np.ndarray:
    """Indices where a run begins: consecutive entries whose values grow by `step` (1 for block ids,
    a unit's bytes for byte offsets) in `first` and, when given, in `second` too are one run.
    [num_runs] int64; empty for empty input."""
    a = np.asarray(first, dtype=np.int64).reshape(-1)
    if len(a) == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = np.diff(a) != step
    if second is not None:
        breaks |= np.diff(np.asarray(second, dtype=np.int64).reshape(-1)) != step
    return np.flatnonzero(np.concatenate(([True], breaks)))


def run_lengths(starts: np.ndarray, num_entries: int) -> np.ndarray:
    """Entries per run, for `starts = run_starts(...)` over `num_entries` entries. [num_runs] int64."""
    return np.diff(np.append(starts, num_entries))


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Run]:
    """A block mapping src_ids[i] -> dst_ids[i] as runs contiguous on both sides, in order."""
    starts = run_starts(src_ids, dst_ids)
    lengths = run_lengths(starts, len(src_ids))
    return [(int(src_ids[s]), int(dst_ids[s]), int(n)) for s, n in zip(starts, lengths)]


def capped_runs(ids: Sequence[int], max_len: int) -> list[tuple[int, int]]:
    """(index of the first entry, length) of each run of consecutive `ids`, cut at `max_len`."""
    starts = run_starts(ids)
    out: list[tuple[int, int]] = []
    for start, length in zip(starts.tolist(), run_lengths(starts, len(ids)).tolist()):
        out.extend((i, min(max_len, start + length - i)) for i in range(start, start + length, max_len))
    return out


def is_one_run(ids: Sequence[int]) -> bool:
    """True when `ids` are consecutive ascending (or fewer than two)."""
    return len(run_starts(ids)) <= 1


def find_run(sorted_free: Sequence[int], n: int, prefer_start: int | None = None) -> int | None:
    """Index into `sorted_free` (ascending, no duplicates) of `n` consecutive ids, or None.

    The run starting at id `prefer_start` when it is free, else the first one. Skips past gaps,
    so a search looks at each entry about once (a pure-Python loop: the pool's free list is a list).
    """
    if prefer_start is not None:
        i = bisect.bisect_left(sorted_free, prefer_start)
        if i + n <= len(sorted_free) and sorted_free[i] == prefer_start and sorted_free[i + n - 1] == prefer_start + n - 1:
            return i
    i = 0
    while i + n <= len(sorted_free):
        j = i + n - 1
        if sorted_free[j] - sorted_free[i] == n - 1:
            return i
        # The window has a gap; restart after the last gap inside it.
        k = j
        while sorted_free[k] - sorted_free[k - 1] == 1:
            k -= 1
        i = k
    return None
