"""Block ids -> coalesced byte ranges and NIXL descriptor arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.descriptors import (
    Unit,
    block_descs,
    coalesce_blocks,
    num_merged_ranges,
    range_descs,
    region_addresses,
    transfer_unit,
    unit_indices,
    unit_offsets,
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


# ---------------------------------------------------------------------- strided page layouts

GEO = dict(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
P = 2 * 4 * 2 * 8 * 2  # page_nbytes: 256


def block_major(num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout(num_blocks, **GEO)


def layer_major(num_blocks: int, spare_blocks: int = 0) -> KVCacheLayout:
    """Layer-outermost (vLLM's CPU backend); `spare_blocks` of room after each layer's pages."""
    return KVCacheLayout(num_blocks, **GEO, layer_stride=(num_blocks + spare_blocks) * P, block_stride=P)


def padded(num_blocks: int, pad: int = 128) -> KVCacheLayout:
    """Block-outermost with `pad` bytes after each block (vLLM on GPU can pad its blocks)."""
    return KVCacheLayout(num_blocks, **GEO, layer_stride=P, block_stride=4 * P + pad)


MAKERS = {"block-major": block_major, "layer-major": layer_major, "padded": padded,
          "layer-major-spare": lambda n: layer_major(n, spare_blocks=3)}  # fmt: skip


def _page_pairs(ranges, local_layout, remote_layout):
    """(local page offset, remote page offset) for every page the ranges copy, checking that each
    range starts on a page of both layouts and covers whole pages."""
    local_pages = set(local_layout.page_offsets(range(local_layout.num_blocks)).reshape(-1).tolist())
    remote_pages = set(remote_layout.page_offsets(range(remote_layout.num_blocks)).reshape(-1).tolist())
    pairs = []
    for lo, ro, n in zip(ranges.local_offsets.tolist(), ranges.remote_offsets.tolist(), ranges.nbytes.tolist()):
        assert n > 0 and n % P == 0, n
        for k in range(n // P):  # every page inside a range is a real page on both sides: no padding copied
            assert lo + k * P in local_pages and ro + k * P in remote_pages, (lo, ro, n, k)
            pairs.append((lo + k * P, ro + k * P))
    return pairs


def _reference_pairs(local_ids, remote_ids, local_layout, remote_layout):
    """The brute-force truth: page (l, local block) <-> page (l, remote block), one by one."""
    pairs = []
    for lid, rid in zip(local_ids, remote_ids):
        for layer in range(local_layout.num_layers):
            pairs.append((layer * local_layout.layer_stride_bytes + lid * local_layout.block_stride_bytes,
                          layer * remote_layout.layer_stride_bytes + rid * remote_layout.block_stride_bytes))
    return pairs


def _nixl_merge(local_descs, local_idx, remote_descs, remote_idx):
    """What NIXL makes of a post by index: entries adjacent on both sides, in posting order, merge."""
    out = []
    for li, ri in zip(local_idx.tolist(), remote_idx.tolist()):
        (la, ln, _), (ra, rn, _) = local_descs[li].tolist(), remote_descs[ri].tolist()
        assert ln == rn
        if out and out[-1][0] + out[-1][2] == la and out[-1][1] + out[-1][2] == ra:
            out[-1][2] += ln
        else:
            out.append([la, ra, ln])
    return out


def test_a_run_of_256_blocks_over_32_layers_costs_one_range_block_major_and_32_layer_major():
    geo = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB pages
    bm = KVCacheLayout(1024, **geo)
    page = bm.page_nbytes
    lm = KVCacheLayout(1024, **geo, layer_stride=1024 * page, block_stride=page)
    pd = KVCacheLayout(1024, **geo, layer_stride=page, block_stride=32 * page + 4096)
    local, remote = np.arange(100, 356), np.arange(500, 756)
    assert coalesce_blocks(local, remote, bm, bm).num_descriptors == 1  # as before strided layouts
    ranges = coalesce_blocks(local, remote, lm, lm)
    assert ranges.num_descriptors == 32 and (ranges.nbytes == 256 * page).all()  # one per layer
    assert coalesce_blocks(local, remote, pd, pd).num_descriptors == 256  # one per block
    assert coalesce_blocks(local, remote, bm, pd).num_descriptors == 256
    assert coalesce_blocks(local, remote, lm, bm).num_descriptors == 256 * 32  # one per page
    assert coalesce_blocks(local, remote, lm, lm, max_nbytes=100 * page).num_descriptors == 32 * 3
    for pair in ((bm, bm), (lm, lm), (pd, pd), (lm, bm)):
        assert coalesce_blocks(local, remote, *pair).total_nbytes == 256 * bm.block_nbytes


def test_units_are_blocks_only_when_blocks_are_one_byte_range_on_both_sides():
    assert transfer_unit(block_major(8), padded(8)) is Unit.BLOCK
    assert transfer_unit(block_major(8), layer_major(8)) is Unit.PAGE
    assert transfer_unit(layer_major(8), layer_major(8)) is Unit.PAGE
    # page units go layer by layer: a layer's pages of consecutive blocks follow each other
    lm = layer_major(8)
    assert unit_offsets(lm, [2, 3], Unit.PAGE).tolist() == [2 * P, 3 * P, 10 * P, 11 * P, 18 * P, 19 * P, 26 * P, 27 * P]
    assert unit_indices(lm, [2, 3], Unit.PAGE).tolist() == [2, 3, 10, 11, 18, 19, 26, 27]
    with pytest.raises(IndexError, match="block id 8"):
        unit_offsets(lm, [8], Unit.PAGE)


def test_pages_of_another_size_are_refused():
    with pytest.raises(ValueError, match="block sizes differ"):
        coalesce_blocks([0], [0], layer_major(8), KVCacheLayout(8, **{**GEO, "num_layers": 2}))
    half_pages = KVCacheLayout(8, **{**GEO, "num_layers": 8, "block_size": 2})  # same block bytes, pages half
    with pytest.raises(ValueError, match="page sizes differ"):
        coalesce_blocks([0], [0], block_major(8), half_pages)


@pytest.mark.parametrize("trial", range(40))
def test_random_strided_pairings_copy_exactly_every_page_of_the_requested_blocks(trial):
    seed = 5000 + trial
    rng = random.Random(seed)
    print(f"seed={seed}")
    local_kind, remote_kind = rng.choice(sorted(MAKERS)), rng.choice(sorted(MAKERS))
    local_layout = MAKERS[local_kind](rng.randrange(8, 48))
    remote_layout = MAKERS[remote_kind](rng.randrange(8, 48))
    n = rng.randrange(0, min(local_layout.num_blocks, remote_layout.num_blocks) + 1)
    if rng.random() < 0.5:  # runs: one start per side, broken here and there
        l0 = rng.randrange(0, local_layout.num_blocks - n + 1)
        r0 = rng.randrange(0, remote_layout.num_blocks - n + 1)
        local, remote = list(range(l0, l0 + n)), list(range(r0, r0 + n))
        if n > 2:
            i, j = rng.sample(range(n), 2)
            remote[i], remote[j] = remote[j], remote[i]
    else:
        local, remote = rng.sample(range(local_layout.num_blocks), n), rng.sample(range(remote_layout.num_blocks), n)
    max_nbytes = rng.choice([None, P, 3 * P + 5, 4 * P, 9 * P])
    ranges = coalesce_blocks(local, remote, local_layout, remote_layout, max_nbytes)
    got = _page_pairs(ranges, local_layout, remote_layout)
    expected = _reference_pairs(local, remote, local_layout, remote_layout)
    assert sorted(got) == sorted(expected), f"seed={seed} {local_kind} <- {remote_kind}"
    assert len(got) == len(set(got))  # no page twice
    unit = transfer_unit(local_layout, remote_layout)
    smallest = local_layout.block_nbytes if unit is Unit.BLOCK else P
    if max_nbytes is not None:
        assert (ranges.nbytes <= max(smallest, max_nbytes)).all(), f"seed={seed}"
    # minimal: no two consecutive ranges could have been merged without exceeding the limit
    for i in range(ranges.num_descriptors - 1):
        adjacent = (ranges.local_offsets[i] + ranges.nbytes[i] == ranges.local_offsets[i + 1]
                    and ranges.remote_offsets[i] + ranges.nbytes[i] == ranges.remote_offsets[i + 1])
        assert not adjacent or (max_nbytes is not None and ranges.nbytes[i] + ranges.nbytes[i + 1] > max_nbytes)
    # "blocks" mode: cached lists posted by unit index merge (as NIXL does) into the same ranges
    local_descs, remote_descs = block_descs(local_layout, 0, 0, unit), block_descs(remote_layout, 0, 0, unit)
    merged = _nixl_merge(local_descs, unit_indices(local_layout, local, unit),
                         remote_descs, unit_indices(remote_layout, remote, unit))
    unsplit = coalesce_blocks(local, remote, local_layout, remote_layout)
    assert merged == [list(r) for r in zip(*(a.tolist() for a in unsplit))], f"seed={seed}"
    assert num_merged_ranges(np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64), local_layout,
                             remote_layout) == len(merged)


def test_page_lists_name_page_l_b_at_entry_l_times_num_blocks_plus_b():
    lm = layer_major(3, spare_blocks=1)
    descs = block_descs(lm, base_addr=1000, device_id=2, unit=Unit.PAGE)
    assert descs.shape == (12, 3) and (descs[:, 1] == P).all() and (descs[:, 2] == 2).all()
    for layer in range(4):
        for b in range(3):
            assert descs[layer * 3 + b, 0] == 1000 + layer * 4 * P + b * P
    pd = padded(3)
    assert block_descs(pd, 0, 0).tolist() == [[0, 4 * P, 0], [4 * P + 128, 4 * P, 0], [8 * P + 256, 4 * P, 0]]


def test_range_and_block_descriptor_arrays():
    d = range_descs(np.array([0, 4096]), np.array([512, 1024]), base_addr=1 << 40, device_id=3)
    assert d.dtype == np.uint64 and d.shape == (2, 3)
    assert d.tolist() == [[1 << 40, 512, 3], [(1 << 40) + 4096, 1024, 3]]
    blocks = block_descs(LAYOUT.with_num_blocks(3), base_addr=100, device_id=0)
    assert blocks.tolist() == [[100, B, 0], [100 + B, B, 0], [100 + 2 * B, B, 0]]


PER_LAYER = KVCacheLayout.per_layer(LAYOUT.page_nbytes, **{k: getattr(LAYOUT, k) for k in (
    "num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")})  # fmt: skip


def test_per_layer_offsets_land_in_their_layers_region_and_runs_never_span_two_layers():
    """KV held one allocation per layer: a run of a layer's blocks is one range in that layer's region;
    the last block of one layer and the first of the next are never merged (the layout's gap)."""
    P, bases = LAYOUT.page_nbytes, (1 << 40, 1 << 20)  # layer 1's region below layer 0's: any order
    ids = list(range(62, 64)) + [0, 1]  # a run to the end of the cache, then one from its start
    ranges = coalesce_blocks(ids, ids, PER_LAYER)
    descs = range_descs(ranges.local_offsets, ranges.nbytes, bases[0], 3, bases, PER_LAYER.layer_stride_bytes)
    assert descs.tolist() == [
        [bases[0] + 62 * P, 2 * P, 3], [bases[0], 2 * P, 3],  # layer 0: blocks 62-63, then 0-1
        [bases[1] + 62 * P, 2 * P, 3], [bases[1], 2 * P, 3],  # layer 1
    ]
    everything = block_descs(PER_LAYER, bases[0], 0, Unit.PAGE, bases)  # entry l * num_blocks + b = page (l, b)
    assert everything[64 + 5].tolist() == [bases[1] + 5 * P, P, 0] and everything[63].tolist() == [bases[0] + 63 * P, P, 0]
    assert region_addresses([7 * P], 100).tolist() == [100 + 7 * P]  # one region: base + offset
