"""`CudaCopier`: block copies between a CUDA KV cache and the host pool (copy_base.py has the
contract, copier.py the CPU copier and the whole design): dedicated streams and a helper thread per
direction, never the compute stream; completion by CUDA events, which a waiter thread per direction
also sleeps on, so that the engine is woken the moment a copy ends rather than at its next poll.

Two ways to move scattered blocks:

* **direct** (blocks whose bytes are one range in the KV cache: vLLM's cross-layer buffer, kvbridge's
  own engine): one DMA per run of blocks adjacent on both sides, straight between the KV cache and
  the host pool. Only the copy engines work, no SM: the copy keeps its speed while the next forward
  pass fills every SM (a staged gather waits for free SMs behind that pass's kernels).
* **staged** (blocks strided over layers, or one tensor per layer): a gather (store) or scatter
  (load) kernel through a device staging buffer, one DMA per segment of consecutive host slots.

Side kernels (gather, scatter, digest) run on a high-priority stream, so an SM that frees up takes
them ahead of the forward pass's queued blocks. A store's digest reads the same KV blocks as its
DMA and runs beside it; a load's digests the blocks once the load wrote them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvbridge.block_runs import capped_runs, is_one_run, paired_runs
from kvbridge.connectors.offload.copy_base import BlockCopier, CopyHandle, DigestFn
from kvbridge.layer_tensors import LayerTensors
from kvbridge.transfer.digest import DigestJob
from kvbridge.transfer.progress import drive_until


class _CudaHandle(CopyHandle):
    """Done when the helper-thread part (if any) finished and the recorded event completed."""

    def __init__(self, waiter: ThreadPoolExecutor) -> None:
        self._waiter = waiter
        self.future: Future | None = None
        self.event: torch.cuda.Event | None = None
        self.began: torch.cuda.Event | None = None  # on the DMA stream, once the work it waits for ended
        self._ready = threading.Event()  # set once `event` is recorded, or the helper's job failed
        self.digest_job: DigestJob | None = None  # of `digest_ids`, queued before `event`
        self.digest_ids: list[int] = []

    def digests(self) -> dict[int, int]:
        if self.digest_job is None:
            return {}
        return dict(zip(self.digest_ids, self.digest_job.result().values))

    def device_seconds(self) -> float | None:
        if self.began is None or self.event is None:
            return None
        return self.began.elapsed_time(self.event) / 1e3

    def is_done(self) -> bool:
        if self.future is not None and self.future.done() and self.future.exception() is not None:
            self.error = self.future.exception()
            return True
        return self._ready.is_set() and self.event is not None and self.event.query()

    def on_done(self, callback: Callable[[], object]) -> None:
        """`callback()` on the direction's waiter thread once the copy ended: it sleeps on the event
        (a blocking-sync event: no spinning core). Copies of one direction end in order."""

        def wait_then_call() -> None:
            if self.future is not None:
                self.future.exception()  # waits for the helper's job (`before`, then the enqueue), failed or not
            self._ready.wait()
            if self.event is not None:
                self.event.synchronize()
            callback()

        self._waiter.submit(wait_then_call)

    def wait(self, timeout_s: float) -> bool:
        # Events have no timed wait: poll, backing off to at most 0.1 ms (how late a copy's end is seen).
        return drive_until(self.is_done, time.monotonic() + timeout_s, first_wait_s=10e-6, max_wait_s=100e-6)


class CudaCopier(BlockCopier):
    """Per direction: a DMA stream and a (high-priority) kernel stream, a staging buffer split in two
    halves (staged copies only), and a helper thread.

    `direct` (None: wherever each block is one byte range of the KV cache) moves blocks with one DMA
    per run adjacent on both sides, no staging (see the module's doc).

    A scattered segment is gathered (store) or scattered (load) by a kernel on the kernel stream
    while the other half's DMA runs on the DMA stream, so the copy engine never waits for the
    gather/scatter kernels: the transfer runs at the DMA's speed, not DMA + kernel.

    A copy without `before` is enqueued on the caller's thread (a hand-off to another thread was
    measured 2-3 % slower on an H200); one with `before` (disk reads, slot barriers) waits and
    enqueues on its direction's own thread, so a load waiting for the disk never holds up a
    store, nor the other way round.
    """

    def __init__(self, kv_cache: torch.Tensor, host_pool: torch.Tensor, staging_blocks: int,
                 digest: DigestFn | None = None, direct: bool | None = None) -> None:  # fmt: skip
        super().__init__(kv_cache, host_pool, digest)
        device = kv_cache.device
        self._is_per_layer = isinstance(kv_cache, LayerTensors)  # no view spans its layers: always staged
        can_direct = not self._is_per_layer and kv_cache[0].is_contiguous()
        if direct and not can_direct:
            raise ValueError("CudaCopier: direct copies need KV blocks that are each one byte range")
        self.is_direct = can_direct if direct is None else direct
        # adjacent blocks one range too (no padding between them): a run is one DMA, else one per block
        self._max_run = None if can_direct and kv_cache.stride(0) == kv_cache[0].numel() else 1
        # (DMA stream, kernel stream); the kernels' at the highest priority (the lowest number)
        high = torch.cuda.Stream.priority_range()[1]
        self._streams = {d: (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device, priority=high))
                         for d in ("store", "load")}  # fmt: skip
        half = 0 if self.is_direct else max(1, staging_blocks // 2)
        # Two halves per direction: [2, half, L, *page_shape] on the device, contiguous (none for direct copies).
        self._staging = {d: torch.empty((2, half, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=device)
                         for d in ("store", "load")}  # fmt: skip
        self._helpers = {d: ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-offload-cuda-{d}")
                         for d in ("store", "load")}  # fmt: skip
        self._waiters = {d: ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-offload-cuda-{d}-done")
                         for d in ("store", "load")}  # fmt: skip

    def _enqueue(self, direction: str, gpu_ids: list[int], slots: list[int], after: torch.cuda.Event,
                 handle: _CudaHandle) -> None:  # fmt: skip
        dma, kernels = self._streams[direction]
        staging = self._staging[direction]
        device = self.kv_cache.device
        segments: list[tuple[list[int], int]] = []
        if not self.is_direct:
            order = sorted(range(len(slots)), key=slots.__getitem__)  # host side contiguous when possible
            src_ids, dst_slots = [gpu_ids[i] for i in order], [slots[i] for i in order]
            # one gather + one DMA per run of consecutive host slots: (source ids, first slot)
            segments = [(src_ids[i : i + n], dst_slots[i]) for i, n in capped_runs(dst_slots, staging.shape[1])]
        with torch.cuda.device(device):
            caller = torch.cuda.current_stream()
            try:
                dma.wait_event(after)  # the compute stream's work on these blocks comes first
                kernels.wait_event(after)
                # the copy's own time starts here, not when it was enqueued: with CUDA graphs the CPU enqueues a
                # store long before the forward pass that writes its blocks has ended on the device
                handle.began = torch.cuda.Event(enable_timing=True)
                handle.began.record(dma)
                if self.is_direct:
                    self._launch_direct(direction, gpu_ids, slots, dma, kernels, handle)
                else:
                    self._launch(direction, segments, dma, kernels, staging, handle)
                dma.wait_stream(kernels)
                done = torch.cuda.Event(blocking=True, enable_timing=True)  # a waiter thread sleeps on it (`on_done`)
                done.record(dma)
                handle.event = done
            finally:
                torch.cuda.set_stream(caller)  # set_stream: less CPU per switch than `with torch.cuda.stream`
        handle._ready.set()

    def _launch_direct(self, direction: str, gpu_ids: list[int], slots: list[int], dma: torch.cuda.Stream,
                       kernels: torch.cuda.Stream, handle: _CudaHandle) -> None:  # fmt: skip
        """Enqueue one DMA per run of blocks adjacent on both sides, and the digest of the KV-side blocks
        (with a `digest`: a store's beside its DMAs, a load's after them). Switches this thread's current
        stream: the caller restores it."""
        is_store = direction == "store"
        if self.digest is not None and is_store:  # reads the blocks the DMAs read: no need to wait for them
            self._queue_digest(handle, kernels, list(gpu_ids))
        torch.cuda.set_stream(dma)
        for gpu, slot, n in paired_runs(gpu_ids, slots):
            step = self._max_run or n
            for k in range(0, n, step):
                dev, host = self.kv_cache[gpu + k : gpu + k + step], self.host_pool[slot + k : slot + k + step]
                (host.copy_(dev, non_blocking=True) if is_store else dev.copy_(host, non_blocking=True))
        if self.digest is not None and not is_store:  # the bytes the load wrote, once written
            kernels.wait_stream(dma)
            self._queue_digest(handle, kernels, list(gpu_ids))

    def _launch(self, direction: str, segments: list[tuple[list[int], int]], dma: torch.cuda.Stream,
                kernels: torch.cuda.Stream, staging: torch.Tensor, handle: _CudaHandle) -> None:  # fmt: skip
        """Enqueue every segment's gather/scatter and DMA, then the digest of the KV-side blocks (with a
        `digest`). Switches this thread's current stream: the caller restores it."""
        device = self.kv_cache.device
        torch.cuda.set_stream(kernels)
        # every segment's block ids in one pinned host tensor, one upload: no pageable copy
        # (which would block this thread until the stream drains) inside the loop
        flat = torch.tensor([b for ids, _ in segments for b in ids], dtype=torch.long).pin_memory()
        index = flat.to(device, non_blocking=True)
        half_free: list[torch.cuda.Event | None] = [None, None]  # when each half may be reused
        offset = 0
        for k, (ids, slot0) in enumerate(segments):
            n, host = len(ids), self.host_pool[slot0 : slot0 + len(ids)]
            seg_index, offset = index[offset : offset + n], offset + n
            if is_one_run(ids) and not self._is_per_layer:  # strided KV: torch stages it on `dma` (a temporary, same cost)
                torch.cuda.set_stream(dma)
                dev = self.kv_cache[ids[0] : ids[0] + n]
                (host.copy_(dev, non_blocking=True) if direction == "store" else dev.copy_(host, non_blocking=True))
                continue
            buf = staging[k % 2, :n]
            if direction == "store":
                if half_free[k % 2] is not None:
                    kernels.wait_event(half_free[k % 2])  # its previous DMA has read it
                torch.cuda.set_stream(kernels)
                if self._is_per_layer:  # KV held one tensor per layer: a gather from each
                    self.kv_cache.gather_into(seg_index, buf)
                else:
                    torch.index_select(self.kv_cache, 0, seg_index, out=buf)  # gather on the device
                gathered = torch.cuda.Event()
                gathered.record(kernels)
                dma.wait_event(gathered)
                torch.cuda.set_stream(dma)
                host.copy_(buf, non_blocking=True)  # one DMA
                half_free[k % 2] = torch.cuda.Event()
                half_free[k % 2].record(dma)
            else:
                if half_free[k % 2] is not None:
                    dma.wait_event(half_free[k % 2])  # its previous scatter has read it
                torch.cuda.set_stream(dma)
                buf.copy_(host, non_blocking=True)  # one DMA
                landed = torch.cuda.Event()
                landed.record(dma)
                kernels.wait_event(landed)
                torch.cuda.set_stream(kernels)
                self.kv_cache.index_copy_(0, seg_index, buf)  # scatter on the device
                half_free[k % 2] = torch.cuda.Event()
                half_free[k % 2].record(kernels)
        if self.digest is not None:  # a store: the blocks it read, beside its DMAs; a load: the blocks it wrote, once written
            if direction == "load":
                kernels.wait_stream(dma)
            self._queue_digest(handle, kernels, [b for ids, _ in segments for b in ids])

    def _queue_digest(self, handle: _CudaHandle, kernels: torch.cuda.Stream, ids: list[int]) -> None:
        """The digests of KV blocks `ids`, queued on the kernel stream (made this thread's current one)."""
        torch.cuda.set_stream(kernels)
        handle.digest_ids = ids
        handle.digest_job = self.digest(ids)

    def _submit(self, direction, gpu_ids, slots, before) -> CopyHandle:
        handle = _CudaHandle(self._waiters[direction])
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.kv_cache.device))  # on the caller's thread: its forward pass

        if before is None:
            self._enqueue(direction, gpu_ids, slots, after, handle)
            return handle

        def job() -> None:
            try:
                before()
                self._enqueue(direction, gpu_ids, slots, after, handle)
            finally:
                handle._ready.set()  # also when it failed: the waiter must not wait for an event never recorded

        handle.future = self._helpers[direction].submit(job)
        return handle

    def store(self, gpu_ids, slots, before=None) -> CopyHandle:
        return self._submit("store", gpu_ids, slots, before)

    def load(self, slots, gpu_ids, before=None) -> CopyHandle:
        return self._submit("load", gpu_ids, slots, before)

    def close(self) -> None:
        for pool in (*self._helpers.values(), *self._waiters.values()):
            pool.shutdown(wait=True)  # helpers first: a waiter waits for its copy's event to be recorded
        for streams in self._streams.values():
            for stream in streams:
                stream.synchronize()
        self._staging.clear()
        super().close()
