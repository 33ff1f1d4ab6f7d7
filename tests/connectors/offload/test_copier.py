"""The copy engine: run coalescing, and block copies on the CPU thread and the CUDA stream path."""

from __future__ import annotations

import pytest
import torch

from kvbridge.connectors.offload.copier import coalesce_runs, make_copier, split_dst_contiguous
from kvbridge.connectors.offload.host_tier import HostTier
from kvbridge.layout import KVCacheLayout

SHAPE = (3, 2, 4, 2, 8)  # [L, 2, block_size, H, D]


def test_coalesce_runs_merges_adjacent_ids_on_both_sides():
    assert coalesce_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert coalesce_runs([], []) == []


def test_split_dst_contiguous_respects_max_len():
    segments = split_dst_contiguous([9, 3, 7, 1, 2], [0, 1, 2, 5, 6], max_len=2)
    assert segments == [([9, 3], 0), ([7], 2), ([1, 2], 5)]


def _check_round_trip(device: str, staging_blocks: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((10, *SHAPE), generator=gen).to(device)
    host = torch.zeros((6, *SHAPE), pin_memory=device != "cpu")
    copier = make_copier(kv, host, staging_blocks)
    gpu_ids, slots = [7, 2, 3, 4, 9], [0, 1, 2, 3, 5]  # scattered and contiguous parts
    assert copier.store(gpu_ids, slots).wait(10)
    for g, s in zip(gpu_ids, slots):
        assert torch.equal(host[s], kv[g].cpu())
    target = [0, 1, 5, 6, 8]
    handle = copier.load(slots, target, before=lambda: None)
    assert handle.wait(10) and handle.error is None
    for g, s in zip(target, slots):
        assert torch.equal(kv[g].cpu(), host[s])
    copier.close()


def test_thread_copier_round_trip():
    _check_round_trip("cpu")


def test_thread_copier_reports_errors():
    kv, host = torch.zeros((4, *SHAPE)), torch.zeros((2, *SHAPE))
    copier = make_copier(kv, host)

    def fail() -> None:
        raise OSError("disk gone")

    handle = copier.load([0], [1], before=fail)
    assert handle.wait(10) and isinstance(handle.error, OSError)
    copier.close()


@pytest.mark.gpu
def test_cuda_copier_round_trip_on_side_streams():
    _check_round_trip("cuda", staging_blocks=2)


# vLLM's CPU placement: pages [H, 2, block_size, D], layer-outermost, with room for 2 more blocks per layer
PAGE = 2 * 4 * 2 * 8 * 4  # page_nbytes in float32
LAYER_MAJOR = KVCacheLayout(10, 3, 4, 2, 8, "float32", page_format="H2ND", layer_stride=12 * PAGE, block_stride=PAGE)


def _check_strided_round_trip(device: str) -> None:
    layout = LAYER_MAJOR
    gen = torch.Generator().manual_seed(1)
    buffer = torch.randn(layout.region_nbytes // 4, generator=gen).to(device)
    kv = buffer.as_strided(layout.shape, layout.strides)  # [10, 3, 2, 2, 4, 8], what an adapter hands over
    assert not kv.is_contiguous()
    host = HostTier(layout, num_slots=6, pin_memory=device != "cpu")
    assert host.layout.is_contiguous and host.pool.is_contiguous() and tuple(host.pool.shape) == (6, *layout.block_shape)
    copier = make_copier(kv, host.pool, staging_blocks=2)
    gpu_ids, slots = [7, 2, 3, 4, 9], [0, 1, 2, 3, 5]  # scattered and consecutive parts
    assert copier.store(gpu_ids, slots).wait(10)
    for g, s in zip(gpu_ids, slots):
        for layer in range(layout.num_layers):  # page by page, against the buffer's bytes at the layout's offsets
            start = (layout.page_offsets([g])[0, layer]) // 4
            page = buffer[start : start + layout.page_nbytes // 4].cpu().view(layout.page_shape)
            assert torch.equal(host.pool[s, layer], page), (g, s, layer)
        assert torch.equal(host.slot_bytes(s), kv[g].cpu().reshape(-1).view(torch.uint8))  # [L, page] order
    before = buffer.clone()
    target = [0, 1, 5, 6, 8]
    handle = copier.load(slots, target)
    assert handle.wait(10) and handle.error is None
    for g, s in zip(target, slots):
        assert torch.equal(kv[g].cpu(), host.pool[s])
    changed = (buffer != before).cpu().numpy()
    touched = torch.zeros(len(buffer), dtype=torch.bool).numpy()
    for start in layout.page_offsets(target).reshape(-1) // 4:
        touched[start : start + layout.page_nbytes // 4] = True
    assert not changed[~touched].any()  # nothing outside the target pages: other blocks, the spare room
    copier.close()


def test_thread_copier_round_trip_with_a_strided_layer_major_cache():
    _check_strided_round_trip("cpu")


@pytest.mark.gpu
def test_cuda_copier_round_trip_with_a_strided_layer_major_cache():
    _check_strided_round_trip("cuda")
