"""Runs of adjacent block ids (kvbridge/block_runs.py), checked against a block-by-block reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.block_runs import capped_runs, find_run, is_one_run, paired_runs, run_starts


def reference_paired_runs(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def test_run_starts_counts_runs_of_ids_or_of_byte_offsets():
    assert run_starts(np.array([3, 4, 9]), np.array([7, 8, 9])).tolist() == [0, 2]
    assert run_starts(np.array([0, 256, 512]), np.array([256, 512, 0]), 256).tolist() == [0, 2]
    assert run_starts([1, 2, 3, 7, 9, 10]).tolist() == [0, 3, 4]
    assert run_starts([]).size == 0


def test_paired_runs_merges_adjacent_ids_on_both_sides():
    assert paired_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert paired_runs([], []) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_runs_random(seed):
    print("seed", seed)
    rng = random.Random(seed)
    src = sorted(rng.sample(range(100), 40))
    dst = [i + (i // 7) for i in range(40)]
    assert paired_runs(src, dst) == reference_paired_runs(src, dst)


def test_capped_runs_cuts_runs_of_one_side_at_max_len():
    assert capped_runs([0, 1, 2, 5, 6], max_len=2) == [(0, 2), (2, 1), (3, 2)]
    assert capped_runs([3, 4, 5, 6, 7], max_len=2) == [(0, 2), (2, 2), (4, 1)]
    assert capped_runs([], max_len=4) == []


def test_is_one_run():
    assert is_one_run([4, 5, 6]) and is_one_run([9]) and is_one_run([])
    assert not is_one_run([4, 6]) and not is_one_run([5, 4])


def test_find_run_prefers_the_given_start_then_the_first_fit():
    free = [0, 1, 5, 6, 7, 8, 20, 21, 22]
    assert find_run(free, 3) == 2  # 5, 6, 7
    assert find_run(free, 3, prefer_start=20) == 6
    assert find_run(free, 3, prefer_start=1) == 2  # 1 starts no run of 3: the first fit
    assert find_run(free, 5) is None
    assert find_run([], 1) is None and find_run([], 1, prefer_start=3) is None
