"""memory_snapshot.py: snapshots of device and host memory, waiting for late VRAM release."""

from __future__ import annotations

import time

import pytest
import torch
from memory_snapshot import MemorySnapshot, count_live_tensors, rss_bytes, take_snapshot, wait_for_device_memory


def test_cpu_snapshot_has_no_cuda_fields():
    snap = take_snapshot("cpu")
    assert isinstance(snap, MemorySnapshot)
    assert (snap.cuda_allocated, snap.cuda_reserved, snap.cuda_free, snap.cuda_total, snap.cuda_used) == (None,) * 5
    assert snap.rss_bytes > 10 * 2**20 and snap.num_live_tensors >= 0


def test_live_tensor_count_follows_tensors():
    before = count_live_tensors()
    held = [torch.zeros(1) for _ in range(25)]
    assert count_live_tensors() - before == 25
    del held
    assert count_live_tensors() == before


def test_rss_grows_with_touched_memory():
    before = rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, written so it is resident
    assert rss_bytes() - before > 32 * 2**20
    del block


def test_diff_names_every_field():
    a = MemorySnapshot(None, None, None, None, 1000, 5)
    b = MemorySnapshot(None, None, None, None, 1500, 7)
    assert b.diff(a) == {"cuda_allocated": None, "cuda_reserved": None, "cuda_used": None,
                         "rss_bytes": 500, "num_live_tensors": 2, "num_threads": None, "num_fds": None}  # fmt: skip


def test_threads_and_fds_follow_what_the_process_opens():
    import os
    import threading

    before = take_snapshot("cpu")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        during = take_snapshot("cpu")
    finally:
        stop.set()
        thread.join()
        os.close(fd)
    assert during.num_threads - before.num_threads == 1 and during.num_fds - before.num_fds == 1
    assert take_snapshot("cpu").diff(before)["num_threads"] == 0


def test_wait_without_cuda_returns_at_once():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    start = time.monotonic()
    assert wait_for_device_memory(0, timeout_s=5.0, device="cpu") == 0
    assert time.monotonic() - start < 4.0  # it did not wait out the 5 s timeout


@pytest.mark.gpu
def test_cuda_snapshot_and_wait():
    base = take_snapshot("cuda")
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    grown = take_snapshot("cuda")
    assert grown.cuda_allocated - base.cuda_allocated >= 64 * 2**20
    assert grown.cuda_reserved >= grown.cuda_allocated and grown.cuda_used > 0
    used = wait_for_device_memory(grown.cuda_total, timeout_s=1.0, device="cuda")
    assert 0 < used <= grown.cuda_total
    with pytest.raises(TimeoutError, match="still uses"):
        wait_for_device_memory(0, timeout_s=0.2, device="cuda")  # a context alone uses some memory
    del x
    torch.cuda.empty_cache()
    assert take_snapshot("cuda").cuda_allocated == base.cuda_allocated


def test_census_finds_a_leak_by_identity_while_other_things_are_freed_and_caches_are_refilled():
    from kvbridge.testing.memory_snapshot import Census

    unrelated = [torch.zeros(1) for _ in range(5)]
    cache, leaked = {}, []

    def cycle(leak: bool) -> None:
        cache["block"] = torch.zeros(2)  # refilled each cycle: not a leak
        if leak:
            leaked.append(torch.zeros(3, 2))

    before = Census.take()
    cycle(leak=False)
    mid = Census.take(since=before)
    unrelated.clear()  # five released elsewhere: a count would hide one leaked tensor
    cycle(leak=True)
    found = Census.take().leaked(before, mid)
    assert list(found) == ["tensors"] and len(found["tensors"]) == 1, found  # the refill is not a leak
    leaked.clear()
    assert Census.take().leaked(before, mid) == {}
