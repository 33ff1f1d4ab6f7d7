"""The copy engine: shares of runs, and block copies on the CPU threads and the CUDA stream path."""

from __future__ import annotations

import random
import threading
import time
from functools import partial

import pytest
import torch

from kvbridge.connectors.offload import copier as copier_module
from kvbridge.connectors.offload.copier import make_copier
from kvbridge.connectors.offload.host_tier import HostTier
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import WSUM, XXH3, BlockDigester, algorithm_for, block_digests, region_bytes, start_block_digests

SHAPE = (3, 2, 4, 2, 8)  # [L, 2, block_size, H, D]


@pytest.fixture
def shares(monkeypatch):
    """Every share a ThreadCopier copies, as (thread name, runs)."""
    seen: list[tuple[str, list]] = []
    copy_share = copier_module._copy_share

    def spy(src, dst, share, *digest_args):
        seen.append((threading.current_thread().name, share))
        return copy_share(src, dst, share, *digest_args)

    monkeypatch.setattr(copier_module, "_copy_share", spy)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thread_copier_shares_are_even_and_cover_every_block_once(shares, seed):
    print("seed", seed)
    rng = random.Random(seed)
    kv = torch.randn((200, *SHAPE), generator=torch.Generator().manual_seed(seed))
    src = sorted(rng.sample(range(200), 50)) + rng.sample(range(200), 10)
    for num_threads in (1, 2, 3, 7, 500):
        host = torch.zeros((60, *SHAPE))
        copier = make_copier(kv, host, copy_threads=num_threads)
        copier.MIN_SHARE_BYTES = 1
        shares.clear()
        assert copier.store(src, list(range(60))).wait(10)
        assert torch.equal(host, kv[src])
        assert len(shares) == min(num_threads, 60)
        blocks = sorted((s + i, d + i) for _, share in shares for s, d, n in share for i in range(n))
        assert blocks == sorted(zip(src, range(60)))  # each once
        sizes = sorted((sum(n for _, _, n in share) for _, share in shares), reverse=True)
        assert all(size == sizes[0] for size in sizes[:-1])  # only the last share is short
        copier.close()


def test_thread_copier_copies_each_run_of_adjacent_blocks_at_once_split_over_its_threads(shares):
    kv = torch.randn((40, *SHAPE), generator=torch.Generator().manual_seed(3))
    host = torch.zeros((30, *SHAPE))
    copier = make_copier(kv, host, copy_threads=3)
    copier.MIN_SHARE_BYTES = 1  # share even these tiny blocks
    gpu_ids, slots = [5, 6, 7, 8, 20, 21, 3, 30, 31, 32, 33, 34, 35], list(range(13))
    assert copier.store(gpu_ids, slots).wait(10)
    assert torch.equal(host[:13], kv[gpu_ids])
    # runs of 4, 2, 1 and 6 blocks, cut into 3 shares of 5 blocks: 6 copies, not 13
    assert sorted(run for _, share in shares for run in share) == [
        (3, 6, 1), (5, 0, 4), (20, 4, 1), (21, 5, 1), (30, 7, 3), (33, 10, 3)
    ]  # fmt: skip
    names = [name for name, _ in shares]
    assert len(shares) == 3 and all(name.startswith("kvbridge-offload-copy") for name in names)  # straight to the pool
    shares.clear()
    target = [0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17, 39]
    assert copier.load(slots, target).wait(10)
    assert torch.equal(kv[target], host[:13])
    assert sorted(run for _, share in shares for run in share) == [(0, 0, 4), (4, 10, 1), (5, 11, 5), (10, 16, 2), (12, 39, 1)]
    copier.close()


def test_thread_copier_keeps_a_small_copy_in_one_share(shares):
    kv, host = torch.randn((8, *SHAPE)), torch.zeros((4, *SHAPE))
    copier = make_copier(kv, host, copy_threads=4)
    assert copier.num_threads == 4
    assert copier.store([1, 2, 6], [0, 1, 2]).wait(10)  # 3 blocks of 1.5 KiB: below MIN_SHARE_BYTES
    assert torch.equal(host[:3], kv[[1, 2, 6]])
    assert len(shares) == 1 and shares[0][1] == [(1, 0, 2), (6, 2, 1)]  # one copy thread
    assert shares[0][0].startswith("kvbridge-offload-copy")
    handle = copier.load([], [])
    assert handle.wait(10) and handle.error is None  # nothing to copy
    copier.close()


def _check_round_trip(device: str, staging_blocks: int = 2, direct: bool | None = None) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((10, *SHAPE), generator=gen).to(device)
    host = torch.zeros((6, *SHAPE), pin_memory=device != "cpu")
    copier = make_copier(kv, host, staging_blocks, direct=direct)
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


def test_a_failed_share_fails_the_copy_only_once_every_share_ended(monkeypatch):
    kv, host = torch.randn((8, *SHAPE)), torch.zeros((8, *SHAPE))
    copier = make_copier(kv, host, copy_threads=2)
    copier.MIN_SHARE_BYTES = 1
    slow_share_ended = threading.Event()
    copy_share = copier_module._copy_share

    def one_fails_one_is_slow(src, dst, share, *digest_args):
        if share[0][0] == 0:  # the first share fails at once
            raise OSError("copy failed")
        time.sleep(0.2)
        copy_share(src, dst, share, *digest_args)
        slow_share_ended.set()
        return {}

    monkeypatch.setattr(copier_module, "_copy_share", one_fails_one_is_slow)
    handle = copier.store(list(range(8)), list(range(8)))
    assert handle.wait(10) and isinstance(handle.error, OSError)
    assert slow_share_ended.is_set()  # nothing still writes once the copy reports its end
    assert torch.equal(host[4:], kv[4:])
    copier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [None, False], ids=["direct", "staged"])
def test_cuda_copier_round_trip_on_side_streams(direct):
    _check_round_trip("cuda", staging_blocks=2, direct=direct)


def _copy_kernels_and_memcpys(fn) -> tuple[list[str], list[str]]:
    """The names of the CUDA kernels and of the memcpys that `fn()` ran, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    memcpys = [n for n in names if "memcpy" in n.lower()]
    return [n for n in names if n not in memcpys], memcpys


@pytest.mark.gpu
def test_cuda_copies_of_blocks_that_are_one_byte_range_each_use_no_kernel():
    """Blocks laid out block-major (vLLM's cross-layer buffer, kvbridge's engine): scattered blocks go
    host-ward and back by DMA alone, one per run adjacent on both sides, so a forward pass that fills
    every SM cannot hold them up; the staged copier of the same cache gathers through kernels. With a
    digest, the digest kernels are the only ones."""
    kv = torch.randn((64, *SHAPE), device="cuda")
    host = torch.zeros((16, *SHAPE), pin_memory=True)
    gpu_ids, slots = [40, 41, 42, 7, 19, 3, 4, 60], list(range(8))  # runs: 40-42, 7, 19, 3-4, 60
    direct = make_copier(kv, host, 4)
    assert direct.is_direct
    kernels, memcpys = _copy_kernels_and_memcpys(lambda: direct.store(gpu_ids, slots).wait(10))
    assert kernels == [] and len(memcpys) == 5, (kernels, memcpys)
    kernels, memcpys = _copy_kernels_and_memcpys(lambda: direct.load(slots, [9, 10, 11, 12, 13, 50, 2, 30]).wait(10))
    assert kernels == [] and len(memcpys) == 4, (kernels, memcpys)  # runs: 9-13 (slots 0-4), 50, 2, 30
    assert torch.equal(kv[[9, 10, 11, 12, 13, 50, 2, 30]], kv[gpu_ids])
    direct.close()
    numel = kv[0].numel()  # the same blocks with room between them: each its own range, one DMA per block
    padded = torch.randn(64 * (numel + 8), device="cuda").as_strided(kv.shape, (numel + 8, *kv.stride()[1:]))
    spaced = make_copier(padded, host, 4)
    kernels, memcpys = _copy_kernels_and_memcpys(lambda: spaced.store(gpu_ids, slots).wait(10))
    assert spaced.is_direct and kernels == [] and len(memcpys) == 8, (kernels, memcpys)
    assert torch.equal(host[:8].cuda(), padded[gpu_ids])
    spaced.close()
    staged = make_copier(kv, host, 4, direct=False)
    kernels, _ = _copy_kernels_and_memcpys(lambda: staged.store(gpu_ids, slots).wait(10))
    assert kernels, "the staged copier gathers on the device"
    staged.close()
    layout = KVCacheLayout(64, 3, 4, 2, 8, "float32")
    assert tuple(layout.shape[1:]) == tuple(SHAPE)
    digest = BlockDigester(region_bytes(kv, layout), layout, algorithm_for(kv))
    verifying = make_copier(kv, host, 4, digest=digest)
    handle = verifying.store(gpu_ids, slots)
    assert handle.wait(10) and handle.digests() == dict(zip(gpu_ids, block_digests(region_bytes(kv, layout), layout, gpu_ids, WSUM).values))
    verifying.close()


@pytest.mark.gpu
def test_a_direct_cuda_copier_refuses_blocks_that_are_not_one_byte_range():
    layout = LAYER_MAJOR
    kv = torch.zeros(layout.region_nbytes // 4, device="cuda").as_strided(layout.shape, layout.strides)
    host = torch.zeros((4, *layout.block_shape), pin_memory=True)
    with pytest.raises(ValueError, match="one byte range"):
        make_copier(kv, host, 2, direct=True)
    assert not make_copier(kv, host, 2).is_direct  # the default stages them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_on_done_calls_back_once_the_copy_ended(device):
    """The engine sleeps until a copier wakes it: each copy's callback comes once, after its bytes
    landed, with or without a `before` job, and also for a copy whose `before` failed."""
    kv = torch.randn((10, *SHAPE)).to(device)
    host = torch.zeros((6, *SHAPE), pin_memory=device != "cpu")
    copier = make_copier(kv, host, 2)
    ended: list[tuple[str, bool]] = []
    calls = threading.Semaphore(0)

    def watch(name, handle):
        handle.on_done(lambda: (ended.append((name, handle.is_done())), calls.release()))
        return handle

    def fail():
        raise OSError("disk gone")

    watch("store", copier.store([7, 2, 3, 4, 9], [0, 1, 2, 3, 5]))
    watch("load", copier.load([0, 1, 5], [0, 1, 6], before=lambda: time.sleep(0.05)))
    failed = watch("failed", copier.load([2], [8], before=fail))
    for _ in range(3):
        assert calls.acquire(timeout=10), f"only {ended} called back"
    assert sorted(ended) == [("failed", True), ("load", True), ("store", True)]
    assert isinstance(failed.error, OSError)
    assert torch.equal(kv[[0, 1, 6]].cpu(), host[[0, 1, 5]])
    assert not calls.acquire(timeout=0.2), "a callback came twice"
    copier.close()


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
    region = region_bytes(kv, layout)
    digest = partial(start_block_digests, region, layout, alg=algorithm_for(kv))  # xxh3-64 on CPU, wsum64 on CUDA
    copier = make_copier(kv, host.pool, staging_blocks=2, digest=digest)
    gpu_ids, slots = [7, 2, 3, 4, 9], [0, 1, 2, 3, 5]  # scattered and consecutive parts
    handle = copier.store(gpu_ids, slots)
    assert handle.wait(10) and handle.error is None
    stored = block_digests(region, layout, gpu_ids, algorithm_for(kv)).values
    assert handle.digests() == dict(zip(gpu_ids, stored))  # the blocks the store read
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
    assert [handle.digests()[g] for g in target] == stored  # the blocks the load wrote: the same bytes
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


def test_a_copier_with_a_digest_digests_the_kv_side_of_every_copy_as_it_copies():
    """Store: the KV blocks it read; load: the KV blocks it wrote (after the copy), keyed by KV block id,
    equal to transfer/digest.py's digests of those blocks; runs longer than a piece are hashed piece by piece."""
    layout = KVCacheLayout(num_blocks=40, num_layers=3, block_size=2, num_kv_heads=2, head_dim=8, dtype="float32")
    kv = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5))
    host = HostTier(layout, 30, pin_memory=False)
    region = region_bytes(kv, layout)
    copier = make_copier(kv, host.pool, copy_threads=2, digest=partial(start_block_digests, region, layout, alg=XXH3))
    copier.MIN_SHARE_BYTES = 1
    copier_module._DIGEST_PIECE_BYTES, piece = 2 * layout.block_nbytes, copier_module._DIGEST_PIECE_BYTES
    try:
        gpu_ids, slots = [5, 6, 7, 8, 9, 20, 3, 31], list(range(8))
        handle = copier.store(gpu_ids, slots)
        assert handle.wait(10) and handle.error is None
        assert handle.digests() == dict(zip(gpu_ids, block_digests(region, layout, gpu_ids, XXH3).values))
        target = [10, 11, 12, 13, 14, 15, 16, 39]
        handle = copier.load(slots, target)
        assert handle.wait(10) and handle.error is None
        digests = handle.digests()
        assert list(digests) != [] and sorted(digests) == sorted(target)
        assert [digests[t] for t in target] == block_digests(region, layout, gpu_ids, XXH3).values  # the stored bytes
    finally:
        copier_module._DIGEST_PIECE_BYTES = piece
        copier.close()
    plain = make_copier(kv, host.pool)
    handle = plain.store([1], [0])
    assert handle.wait(10) and handle.digests() == {}
    plain.close()


def _check_per_layer_round_trip(device: str) -> None:
    """KV held one tensor per layer (vLLM 0.25's V2 model runner): stores gather every layer's page of a
    block into its slot, loads scatter them back, digests are of the block's bytes in layer order."""
    from kvbridge.layer_tensors import LayerTensors

    geometry = dict(num_blocks=10, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    layout = KVCacheLayout.per_layer(PAGE, **geometry)
    gen = torch.Generator().manual_seed(2)
    layers = [torch.randn((10, *layout.page_shape), generator=gen).to(device) for _ in range(3)]  # three allocations
    kv = LayerTensors(layers, layout)
    host = HostTier(layout, num_slots=6, pin_memory=device != "cpu")
    alg = algorithm_for(kv)
    digest = partial(start_block_digests, region_bytes(kv, layout), layout, alg=alg)
    copier = make_copier(kv, host.pool, staging_blocks=2, digest=digest)
    gpu_ids, slots = [7, 2, 3, 4, 9], [0, 1, 2, 3, 5]
    handle = copier.store(gpu_ids, slots)
    assert handle.wait(10) and handle.error is None
    block_major = KVCacheLayout(**geometry, page_format="2NHD")
    whole = torch.stack([t.cpu() for t in layers], dim=1)  # [10, 3, *page]: the same blocks, block-major
    stored = block_digests(region_bytes(whole.to(device), block_major), block_major, gpu_ids, alg).values
    assert handle.digests() == dict(zip(gpu_ids, stored))
    for g, s in zip(gpu_ids, slots):
        assert torch.equal(host.pool[s], whole[g])
    target = [0, 1, 5, 6, 8]
    handle = copier.load(slots, target)
    assert handle.wait(10) and handle.error is None
    assert [handle.digests()[g] for g in target] == stored
    for g, src in zip(target, gpu_ids):
        for layer in range(3):
            assert torch.equal(layers[layer][g].cpu(), whole[src, layer])
    assert all(torch.equal(layers[layer][b].cpu(), whole[b, layer]) for layer in range(3) for b in (2, 3, 4, 7, 9))
    copier.close()


def test_layer_copier_round_trip_of_a_per_layer_cache():
    _check_per_layer_round_trip("cpu")


@pytest.mark.gpu
def test_cuda_copier_round_trip_of_a_per_layer_cache():
    _check_per_layer_round_trip("cuda")


@pytest.mark.gpu
def test_cuda_copies_are_timed_from_the_end_of_the_work_they_wait_for():
    """A store enqueued while the compute stream still runs (as with CUDA graphs, the CPU far ahead)
    reports its own time on the device, not the compute's: device_seconds ends well under the wall
    time from the hand-over, and under the compute it waited for. CPU copies have no device time."""
    kv = torch.randn((64, *SHAPE), device="cuda")
    host = torch.zeros((64, *SHAPE), pin_memory=True)
    copier = make_copier(kv, host, 8)
    a = torch.randn((4096, 4096), device="cuda")
    (a @ a).tanh_()  # cuBLAS set up now: its first call blocks the CPU, and the compute below must not
    torch.cuda.synchronize()
    compute_start, compute_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    compute_start.record()
    for _ in range(40):  # tens of milliseconds of compute on the caller's stream, still running below
        a = (a @ a).tanh_()
    compute_end.record()
    started = time.monotonic()
    handle = copier.store(list(range(0, 64, 2)), list(range(32)))
    assert handle.wait(30) and handle.error is None
    wall_s = time.monotonic() - started
    compute_s = compute_start.elapsed_time(compute_end) / 1e3
    device_s = handle.device_seconds()
    # the store's own time: a small fraction of the compute it waited for, and of the wall time since the hand-over
    assert device_s is not None and 0 < device_s < compute_s / 10 and device_s < wall_s / 10, (device_s, compute_s, wall_s)
    assert torch.equal(host[:32].cpu(), kv[0:64:2].cpu())
    copier.close()
    cpu = make_copier(kv.cpu(), torch.zeros_like(host), 2)
    cpu_handle = cpu.store([0, 1], [0, 1])
    assert cpu_handle.wait(10) and cpu_handle.device_seconds() is None
    cpu.close()
