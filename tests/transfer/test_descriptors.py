"""Block ids -> coalesced byte ranges, NIXL descriptor arrays, and contiguous allocation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.descriptors import (
    block_descs,
    coalesce_blocks,
    contiguous_runs,
    range_descs,
    take_contiguous,
)

LAYOUT = KVCacheLayout(num_blocks=64, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
B = LAYOUT.block_nbytes  # 512 bytes


def _expand(ranges, block_nbytes):
    """(local block, remote block) pairs a set of ranges copies, in order."""
    pairs = []
    for lo, ro, n in zip(ranges.local_offsets, ranges.remote_offsets, ranges.nbytes):
        assert lo % block_nbytes == 0 and ro % block_nbytes == 0 and n % block_nbytes == 0 and n > 0
        for k in range(n // block_nbytes):
            pairs.append((lo // block_nbytes + k, ro // block_nbytes + k))
    return pairs


def test_runs_adjacent_on_both_sides_coalesce():
    r = coalesce_blocks([3, 4, 5, 9, 10, 11], [20, 21, 22, 23, 24, 40], LAYOUT)
    assert r.local_offsets.tolist() == [3 * B, 9 * B, 11 * B]
    assert r.remote_offsets.tolist() == [20 * B, 23 * B, 40 * B]
    assert r.nbytes.tolist() == [3 * B, 2 * B, B]
    assert r.num_descriptors == 3 and r.total_nbytes == 6 * B


def test_adjacent_on_one_side_only_does_not_coalesce():
    r = coalesce_blocks([1, 2, 3], [7, 5, 6], LAYOUT)
    assert r.num_descriptors == 2  # (1->7), (2,3 -> 5,6)
    assert r.nbytes.tolist() == [B, 2 * B]


def test_split_at_max_size_rounds_down_to_whole_blocks():
    r = coalesce_blocks(list(range(10)), list(range(30, 40)), LAYOUT, max_nbytes=3 * B + 17)
    assert r.nbytes.tolist() == [3 * B, 3 * B, 3 * B, B]
    assert r.local_offsets.tolist() == [0, 3 * B, 6 * B, 9 * B]
    assert coalesce_blocks([0, 1], [0, 1], LAYOUT, max_nbytes=1).num_descriptors == 2  # at least one block


def test_empty_and_invalid_inputs():
    assert coalesce_blocks([], [], LAYOUT).num_descriptors == 0
    with pytest.raises(ValueError, match="2 local block ids but 1"):
        coalesce_blocks([1, 2], [1], LAYOUT)
    with pytest.raises(IndexError, match="64"):
        coalesce_blocks([64], [0], LAYOUT)
    with pytest.raises(IndexError):
        coalesce_blocks([0], [5], LAYOUT, LAYOUT.with_num_blocks(4))
    other = KVCacheLayout(8, 2, 8, 2, 8, "bfloat16")
    with pytest.raises(ValueError, match="block sizes differ"):
        coalesce_blocks([0], [0], LAYOUT, other)


@pytest.mark.parametrize("trial", range(20))
def test_random_pairings_copy_exactly_the_requested_blocks(trial):
    seed = 1000 + trial
    rng = random.Random(seed)
    print(f"seed={seed}")
    n = rng.randrange(0, 40)
    remote_layout = LAYOUT.with_num_blocks(rng.randrange(max(n, 1), 100))
    # mostly-contiguous ids with random breaks on either side
    local = sorted(rng.sample(range(LAYOUT.num_blocks), n)) if rng.random() < 0.5 else rng.sample(range(64), n)
    remote = rng.sample(range(remote_layout.num_blocks), n)
    if rng.random() < 0.5:
        start = rng.randrange(0, remote_layout.num_blocks - n + 1)
        remote = list(range(start, start + n))
    max_nbytes = rng.choice([None, B, 3 * B, 7 * B + 1])
    r = coalesce_blocks(local, remote, LAYOUT, remote_layout, max_nbytes)
    assert _expand(r, B) == list(zip(local, remote)), f"seed={seed}"
    if max_nbytes:
        assert (r.nbytes <= max(B, max_nbytes)).all()
    # minimal: no two consecutive ranges could have been merged without exceeding the limit
    for i in range(r.num_descriptors - 1):
        contiguous = (r.local_offsets[i] + r.nbytes[i] == r.local_offsets[i + 1]
                      and r.remote_offsets[i] + r.nbytes[i] == r.remote_offsets[i + 1])
        assert not contiguous or (max_nbytes is not None and r.nbytes[i] + r.nbytes[i + 1] > max_nbytes)


def test_range_and_block_descriptor_arrays():
    d = range_descs(np.array([0, 4096]), np.array([512, 1024]), base_addr=1 << 40, device_id=3)
    assert d.dtype == np.uint64 and d.shape == (2, 3)
    assert d.tolist() == [[1 << 40, 512, 3], [(1 << 40) + 4096, 1024, 3]]
    blocks = block_descs(LAYOUT.with_num_blocks(3), base_addr=100, device_id=0)
    assert blocks.tolist() == [[100, B, 0], [100 + B, B, 0], [100 + 2 * B, B, 0]]


def test_contiguous_runs():
    firsts, lengths = contiguous_runs([1, 2, 3, 7, 9, 10])
    assert firsts.tolist() == [1, 7, 9] and lengths.tolist() == [3, 1, 2]
    assert contiguous_runs([])[0].size == 0


def test_take_contiguous_prefers_one_best_fit_run_then_longest_runs():
    free = [0, 1, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 40]
    assert take_contiguous(free, 3).tolist() == [5, 6, 7]  # smallest run that fits
    assert take_contiguous(free, 6).tolist() == [20, 21, 22, 23, 24, 25]
    got = take_contiguous(free, 9)  # no single run: longest first (6) then next longest (4, partially)
    assert got.tolist() == [5, 6, 7, 20, 21, 22, 23, 24, 25]
    assert len(contiguous_runs(got)[0]) == 2
    assert take_contiguous(free, 0).size == 0
    with pytest.raises(ValueError, match="only 13 free"):
        take_contiguous(free, 14)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_take_contiguous_random(seed):
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    free = np.flatnonzero(rng.random(500) < 0.6)
    for n in (1, 5, 50, len(free)):
        got = take_contiguous(free, n)
        assert len(got) == n == len(set(got.tolist())) and set(got.tolist()) <= set(free.tolist())
