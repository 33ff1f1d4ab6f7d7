"""Moves whole blocks between the KV cache and the host pool, asynchronously.

Two implementations behind one interface:

* `ThreadCopier` (CPU KV cache): a copy's blocks are cut into shares for a pool of copy threads,
  one per core, which both directions share; runs of adjacent block ids on both sides coalesce
  into one copy.
* `CudaCopier` (CUDA KV cache): dedicated streams and a helper thread per direction, never the
  compute stream.
  Scattered GPU blocks are gathered with `index_select` into a device staging buffer, which then
  goes to a contiguous range of (pinned) host slots in one DMA; loads do the reverse with
  `index_copy_`. Two staging halves let one segment's DMA overlap the next one's kernel. Runs
  contiguous on both sides skip the staging buffer. A store first waits (on
  the GPU, not the host) for an event recorded on the compute stream, so it reads the blocks the
  forward pass wrote without delaying it. Completion is signalled by CUDA events.

The KV cache may be a strided view (`KVCacheLayout.strides`, e.g. vLLM's layer-outermost buffer);
the host pool is contiguous. Every copy works on [blocks, layers, *page_shape] views that follow
each tensor's strides (torch on CUDA, numpy views of the same memory on CPU): nothing here assumes
the KV cache is contiguous.

`before`, when given, runs on a helper thread of the copy's direction ahead of the copy (disk reads,
barriers, test delays).

Digests (the offload tiers verify what they load, docs/offload.md "Integrity"): a copier made with
a `digest` function also digests the KV-cache side of every copy as part of it — the blocks a store
read, the blocks a load wrote — on the device that holds them: on CPU each copy thread hashes the
blocks it just copied, a piece at a time while they are still in its cache; on CUDA the digest is
queued on the copy's kernel stream behind the copy. `CopyHandle.digests()` returns them once done.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvbridge.block_runs import Run, capped_runs, is_one_run, paired_runs
from kvbridge.transfer.digest import DigestJob
from kvbridge.transfer.progress import drive_until

# KV block ids -> their digests, started on the calling thread (CPU: computed there; CUDA: queued on
# the current stream). transfer/digest.py's `BlockDigester` (`start_block_digests` bound to a region and a layout).
DigestFn = Callable[[list[int]], DigestJob]
_DIGEST_PIECE_BYTES = 1 << 20  # CPU: copy this much, then hash it while it is in the copy thread's cache


class CopyHandle(ABC):
    """One asynchronous copy. `error` is set when it failed."""

    error: BaseException | None = None

    def digests(self) -> dict[int, int]:
        """KV block id -> the digest of its bytes as copied; empty for a copier without `digest`.
        Called once the copy is done and did not fail."""
        return {}

    @abstractmethod
    def is_done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float) -> bool:
        """Block until done or `timeout_s` passed; True when done."""

    def on_done(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the copy ended, on the thread that ends it. A copy that only
        polling can see end (a CUDA event) never calls it: its owner polls."""


class _FutureHandle(CopyHandle):
    def __init__(self, future: Future) -> None:
        self._future = future

    def on_done(self, callback: Callable[[], object]) -> None:
        self._future.add_done_callback(lambda _: callback())

    def digests(self) -> dict[int, int]:
        return self._future.result() or {}

    def is_done(self) -> bool:
        if self._future.done() and self.error is None and self._future.exception() is not None:
            self.error = self._future.exception()
        return self._future.done()

    def wait(self, timeout_s: float) -> bool:
        try:
            self._future.result(timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return False
        except BaseException as exc:  # the copy failed: report through `error`
            self.error = exc
        return True


class BlockCopier(ABC):
    """Copies blocks `kv[gpu_ids] <-> host[slots]` off the engine thread."""

    def __init__(self, kv_cache: torch.Tensor, host_pool: torch.Tensor, digest: DigestFn | None = None) -> None:
        self.kv_cache = kv_cache  # [num_blocks, L, *page_shape], possibly a strided view
        self.host_pool = host_pool  # [num_slots, L, *page_shape], contiguous
        self.digest = digest  # digests of the KV-cache side of each copy, or None

    @abstractmethod
    def store(self, gpu_ids: list[int], slots: list[int], before: Callable[[], None] | None = None) -> CopyHandle:
        """kv_cache[gpu_ids] -> host_pool[slots], after this step's forward pass."""

    @abstractmethod
    def load(self, slots: list[int], gpu_ids: list[int], before: Callable[[], None] | None = None) -> CopyHandle:
        """host_pool[slots] -> kv_cache[gpu_ids]."""

    def close(self) -> None:
        """Stop threads; drop tensor references. In-flight copies must be finished first."""
        self.kv_cache = self.host_pool = None


def _byte_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a uint8 numpy view, same strides ([.., page bytes]; the page is contiguous)."""
    return tensor.view(torch.uint8).numpy()


class ThreadCopier(BlockCopier):
    """CPU KV cache: copies with every core the process may run on, as a memcpy would.

    A copy is cut by position into about equal shares of at least `MIN_SHARE_BYTES`, at most one
    per copy thread (`num_threads`, default: the cores of the process's CPU affinity), and each
    share goes straight from the caller to a pool of `num_threads` copy threads that both
    directions share (a store and a load at once take turns on the same threads: two cores have
    one memory bus). Each thread coalesces its share into runs adjacent on both sides (a run is cut
    where a share ends) and copies them, one numpy copy loop per run (`_copy`; it releases the
    GIL). The copy is done when its last share is. No thread in between: every hand-off is a
    wake-up, which a loaded machine delays by up to a time slice (the former dispatch thread per
    direction: docs/benchmarks.md, "Offload copies on CPU", commits a20fb44 and 2895b24). A copy
    with `before` (it may block on the disk) runs that on its direction's helper thread first, so
    it never holds a copy thread while it waits.

    Not torch's `copy_`: that forks its own intra-op threads for every run (the former path:
    `store_torch_copy_per_run` in offload_bw.py), and torch copies running on several threads at
    once would each fork a team over the same cores; `torch.set_num_threads(1)` on a copy thread is
    no cure, it also changes the default of every thread torch starts later.
    """

    MIN_SHARE_BYTES = 1 << 20  # below this, another thread costs more than it copies

    def __init__(self, kv_cache: torch.Tensor, host_pool: torch.Tensor, num_threads: int | None = None,
                 digest: DigestFn | None = None) -> None:  # fmt: skip
        super().__init__(kv_cache, host_pool, digest)
        self.num_threads = num_threads or len(os.sched_getaffinity(0))
        self.block_nbytes = host_pool[0].nbytes
        self._kv_bytes, self._host_bytes = _byte_array(kv_cache), _byte_array(host_pool)
        self._helpers = {d: ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-offload-{d}") for d in ("store", "load")}
        self._copy_threads = ThreadPoolExecutor(self.num_threads, thread_name_prefix="kvbridge-offload-copy")

    def _run(self, direction: str, before, src, src_ids, dst, dst_ids) -> CopyHandle:
        if before is None:
            return _FutureHandle(self._start(direction, src, src_ids, dst, dst_ids))

        def job() -> dict[int, int]:
            before()
            return self._start(direction, src, src_ids, dst, dst_ids).result()

        return _FutureHandle(self._helpers[direction].submit(job))

    def _start(self, direction: str, src, src_ids, dst, dst_ids) -> Future:
        """Hand the copy's shares to the copy threads; the future ends with the last of them."""
        digest_args = (self.digest, direction == "load", max(1, _DIGEST_PIECE_BYTES // self.block_nbytes))
        num_ids = len(src_ids)
        num_shares = max(1, min(self.num_threads, num_ids * self.block_nbytes // self.MIN_SHARE_BYTES))
        per_share = max(1, -(-num_ids // num_shares))
        starts = range(0, max(1, num_ids), per_share)  # one empty share for an empty copy
        return _all_of([self._copy_threads.submit(_copy_ids, src, dst, src_ids[i : i + per_share],
                                                  dst_ids[i : i + per_share], *digest_args) for i in starts])  # fmt: skip

    def store(self, gpu_ids, slots, before=None) -> CopyHandle:
        return self._run("store", before, self._kv_bytes, gpu_ids, self._host_bytes, slots)

    def load(self, slots, gpu_ids, before=None) -> CopyHandle:
        return self._run("load", before, self._host_bytes, slots, self._kv_bytes, gpu_ids)

    def close(self) -> None:
        for pool in (*self._helpers.values(), self._copy_threads):
            pool.shutdown(wait=True)
        self._kv_bytes = self._host_bytes = None
        super().close()


def _all_of(futures: list[Future]) -> Future:
    """A future that ends once every one of `futures` ended, never earlier, even when one failed
    (none may still write once the copy is done): their dicts merged, or the first error."""
    combined: Future = Future()
    combined.set_running_or_notify_cancel()
    num_left, lock = [len(futures)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            num_left[0] -= 1
            if num_left[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
            return
        merged: dict[int, int] = {}
        for future in futures:
            merged.update(future.result())
        combined.set_result(merged)

    for future in futures:
        future.add_done_callback(one_done)
    return combined


def _copy_ids(src: np.ndarray, dst: np.ndarray, src_ids, dst_ids, *digest_args) -> dict[int, int]:
    """dst[dst_ids] = src[src_ids] on the calling thread: one copy per run adjacent on both sides."""
    return _copy_share(src, dst, paired_runs(src_ids, dst_ids), *digest_args)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src[...] (uint8, same shape), on the calling thread, without the GIL.

    numpy's SIMD loop of the identity ufunc `positive` (no cast, so no buffering), not `np.copyto`:
    that calls libc's memmove, with which the copier's stores and loads of 2 MiB blocks ran ~10 %
    slower on the 2-core EPYC of docs/benchmarks.md ("Offload copies on CPU")."""
    np.positive(src, out=dst)


def _copy_share(src: np.ndarray, dst: np.ndarray, share: list[Run], digest: DigestFn | None = None,
                kv_is_dst: bool = False, piece_blocks: int = 1) -> dict[int, int]:  # fmt: skip
    """dst[d : d + n] = src[s : s + n] for each run, on the calling thread. With `digest`, a piece of
    at most `piece_blocks` blocks at a time, each piece's KV-side blocks (`dst`'s for a load, `src`'s
    for a store) hashed right after it was copied, while its bytes are in this thread's cache.
    Returns KV block id -> digest (empty without `digest`)."""
    digests: dict[int, int] = {}
    for s, d, n in share:
        if digest is None:
            _copy(dst[d : d + n], src[s : s + n])
            continue
        kv_first = d if kv_is_dst else s
        for k in range(0, n, piece_blocks):
            m = min(piece_blocks, n - k)
            _copy(dst[d + k : d + k + m], src[s + k : s + k + m])
            kv_ids = list(range(kv_first + k, kv_first + k + m))
            digests.update(zip(kv_ids, digest(kv_ids).result().values))
    return digests


class _CudaHandle(CopyHandle):
    """Done when the helper-thread part (if any) finished and the recorded event completed."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self.event: torch.cuda.Event | None = None
        self._ready = threading.Event()  # set once `event` is recorded (or the job failed)
        self.digest_job: DigestJob | None = None  # of `digest_ids`, queued before `event`
        self.digest_ids: list[int] = []

    def digests(self) -> dict[int, int]:
        if self.digest_job is None:
            return {}
        return dict(zip(self.digest_ids, self.digest_job.result().values))

    def is_done(self) -> bool:
        if self.future is not None and self.future.done() and self.future.exception() is not None:
            self.error = self.future.exception()
            return True
        return self._ready.is_set() and self.event.query()

    def wait(self, timeout_s: float) -> bool:
        # Events have no timed wait: poll, backing off to at most 0.1 ms (how late a copy's end is seen).
        return drive_until(self.is_done, time.monotonic() + timeout_s, first_wait_s=10e-6, max_wait_s=100e-6)


class CudaCopier(BlockCopier):
    """Per direction: a DMA stream and a kernel stream, a staging buffer split in two halves, and a
    helper thread.

    A scattered segment is gathered (store) or scattered (load) by a kernel on the kernel stream
    while the other half's DMA runs on the DMA stream, so the copy engine never waits for the
    gather/scatter kernels: the transfer runs at the DMA's speed, not DMA + kernel.

    A copy without `before` is enqueued on the caller's thread (a hand-off to another thread was
    measured 2-3 % slower on an H200); one with `before` (disk reads, slot barriers) waits and
    enqueues on its direction's own thread, so a load waiting for the disk never holds up a
    store, nor the other way round.
    """

    def __init__(self, kv_cache: torch.Tensor, host_pool: torch.Tensor, staging_blocks: int,
                 digest: DigestFn | None = None) -> None:  # fmt: skip
        super().__init__(kv_cache, host_pool, digest)
        device = kv_cache.device
        self._streams = {d: (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
                         for d in ("store", "load")}  # fmt: skip  (DMA stream, kernel stream)
        half = max(1, staging_blocks // 2)
        # Two halves per direction: [2, half, L, *page_shape] on the device, contiguous.
        self._staging = {d: torch.empty((2, half, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=device)
                         for d in ("store", "load")}  # fmt: skip
        self._helpers = {d: ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-offload-cuda-{d}")
                         for d in ("store", "load")}  # fmt: skip

    def _enqueue(self, direction: str, gpu_ids: list[int], slots: list[int], after: torch.cuda.Event,
                 handle: _CudaHandle) -> None:  # fmt: skip
        dma, kernels = self._streams[direction]
        staging = self._staging[direction]
        device = self.kv_cache.device
        order = sorted(range(len(slots)), key=slots.__getitem__)  # host side contiguous when possible
        src_ids, dst_slots = [gpu_ids[i] for i in order], [slots[i] for i in order]
        # one gather + one DMA per run of consecutive host slots: (source ids, first slot)
        segments = [(src_ids[i : i + n], dst_slots[i]) for i, n in capped_runs(dst_slots, staging.shape[1])]
        with torch.cuda.device(device):
            caller = torch.cuda.current_stream()
            try:
                handle.event = self._launch(direction, segments, after, dma, kernels, staging, handle)
            finally:
                torch.cuda.set_stream(caller)  # set_stream: less CPU per switch than `with torch.cuda.stream`
        handle._ready.set()

    def _launch(self, direction: str, segments: list[tuple[list[int], int]], after: torch.cuda.Event,
                dma: torch.cuda.Stream, kernels: torch.cuda.Stream, staging: torch.Tensor,
                handle: _CudaHandle) -> torch.cuda.Event:  # fmt: skip
        """Enqueue every segment's gather/scatter and DMA, then the digest of the KV-side blocks (with a
        `digest`); returns the event that ends them all. Switches this thread's current stream: the
        caller restores it."""
        device = self.kv_cache.device
        dma.wait_event(after)  # the compute stream's work on these blocks comes first
        kernels.wait_event(after)
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
            if is_one_run(ids):  # strided KV: torch stages it on `dma` (a temporary, same cost)
                torch.cuda.set_stream(dma)
                dev = self.kv_cache[ids[0] : ids[0] + n]
                (host.copy_(dev, non_blocking=True) if direction == "store" else dev.copy_(host, non_blocking=True))
                continue
            buf = staging[k % 2, :n]
            if direction == "store":
                if half_free[k % 2] is not None:
                    kernels.wait_event(half_free[k % 2])  # its previous DMA has read it
                torch.cuda.set_stream(kernels)
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
        if self.digest is not None:  # a store: the blocks it read; a load: the blocks it wrote, once written
            kernels.wait_stream(dma)
            torch.cuda.set_stream(kernels)
            handle.digest_ids = [b for ids, _ in segments for b in ids]
            handle.digest_job = self.digest(handle.digest_ids)
        dma.wait_stream(kernels)
        done = torch.cuda.Event()
        done.record(dma)
        return done

    def _submit(self, direction, gpu_ids, slots, before) -> CopyHandle:
        handle = _CudaHandle()
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.kv_cache.device))  # on the caller's thread: its forward pass

        if before is None:
            self._enqueue(direction, gpu_ids, slots, after, handle)
            return handle

        def job() -> None:
            before()
            self._enqueue(direction, gpu_ids, slots, after, handle)

        handle.future = self._helpers[direction].submit(job)
        return handle

    def store(self, gpu_ids, slots, before=None) -> CopyHandle:
        return self._submit("store", gpu_ids, slots, before)

    def load(self, slots, gpu_ids, before=None) -> CopyHandle:
        return self._submit("load", gpu_ids, slots, before)

    def close(self) -> None:
        for helper in self._helpers.values():
            helper.shutdown(wait=True)
        for streams in self._streams.values():
            for stream in streams:
                stream.synchronize()
        self._staging.clear()
        super().close()


def make_copier(
    kv_cache: torch.Tensor, host_pool: torch.Tensor, staging_blocks: int = 64, copy_threads: int | None = None,
    digest: DigestFn | None = None,
) -> BlockCopier:
    """`staging_blocks`: CUDA's staging buffer; `copy_threads`: the CPU copy threads (None: one per core);
    `digest`: digest the KV-cache side of every copy (None: do not)."""
    if kv_cache.is_cuda:
        return CudaCopier(kv_cache, host_pool, staging_blocks, digest)
    return ThreadCopier(kv_cache, host_pool, copy_threads, digest)
