"""The copy engine: run coalescing, and block copies on the CPU thread and the CUDA stream path."""

from __future__ import annotations

import pytest
import torch

from kvbridge.connectors.offload.copier import coalesce_runs, make_copier, split_dst_contiguous

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
