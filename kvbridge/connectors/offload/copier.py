"""Moves whole blocks between the KV cache and the host pool, asynchronously.

Two implementations behind one interface:

* `ThreadCopier` (CPU KV cache): a copy's blocks are cut into shares for a pool of copy threads,
  one per core, which both directions share; runs of adjacent block ids on both sides coalesce
  into one copy.
* `LayerCopier` (CPU KV cache held one tensor per layer, `kvbridge.layer_tensors`): a gather or a
  scatter per layer on a helper thread per direction.
* `CudaCopier` (CUDA KV cache, cuda_copier.py): dedicated streams and a helper thread per
  direction, never the compute stream. Where each block is one byte range of the KV cache, one DMA
  per run of blocks adjacent on both sides, and no SM takes part. Otherwise (blocks strided over
  layers, or per-layer caches) scattered GPU blocks are gathered with `index_select` into a device
  staging buffer, which then goes to a contiguous range of (pinned) host slots in one DMA; loads do
  the reverse with `index_copy_`. Two staging halves let one segment's DMA overlap the next one's
  kernel. Runs contiguous on both sides skip the staging buffer. A store first waits (on
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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvbridge.block_runs import Run, paired_runs
from kvbridge.connectors.offload.copy_base import BlockCopier, CopyHandle, DigestFn
from kvbridge.connectors.offload.cuda_copier import CudaCopier
from kvbridge.layer_tensors import LayerTensors

_DIGEST_PIECE_BYTES = 1 << 20  # CPU: copy this much, then hash it while it is in the copy thread's cache


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


class LayerCopier(BlockCopier):
    """CPU KV cache held one tensor per layer (`LayerTensors`): each copy on its direction's helper
    thread, one gather and one scatter per layer (torch's index ops), then the digest of the KV-side
    blocks. No engine allocates so on CPU today (vLLM's CPU backend keeps one buffer); the path keeps
    per-layer caches whole on every device."""

    def __init__(self, kv_cache: LayerTensors, host_pool: torch.Tensor, digest: DigestFn | None = None) -> None:
        super().__init__(kv_cache, host_pool, digest)
        self._helpers = {d: ThreadPoolExecutor(1, thread_name_prefix=f"kvbridge-offload-layers-{d}") for d in ("store", "load")}

    def _run(self, direction: str, before, gpu_ids, slots) -> CopyHandle:
        kv, host, digest = self.kv_cache, self.host_pool, self.digest

        def job() -> dict[int, int]:
            if before is not None:
                before()
            kv_index, slot_index = torch.tensor(list(gpu_ids), dtype=torch.long), torch.tensor(list(slots), dtype=torch.long)
            if direction == "store":
                host.index_copy_(0, slot_index, kv.index_select(0, kv_index))
            else:
                kv.index_copy_(0, kv_index, host.index_select(0, slot_index))
            return dict(zip(gpu_ids, digest(list(gpu_ids)).result().values)) if digest is not None and gpu_ids else {}

        return _FutureHandle(self._helpers[direction].submit(job))

    def store(self, gpu_ids, slots, before=None) -> CopyHandle:
        return self._run("store", before, gpu_ids, slots)

    def load(self, slots, gpu_ids, before=None) -> CopyHandle:
        return self._run("load", before, gpu_ids, slots)

    def close(self) -> None:
        for pool in self._helpers.values():
            pool.shutdown(wait=True)
        super().close()


def make_copier(
    kv_cache: torch.Tensor, host_pool: torch.Tensor, staging_blocks: int = 64, copy_threads: int | None = None,
    digest: DigestFn | None = None, direct: bool | None = None,
) -> BlockCopier:
    """`staging_blocks`: CUDA's staging buffer; `copy_threads`: the CPU copy threads (None: one per core);
    `digest`: digest the KV-cache side of every copy (None: do not); `direct`: CUDA copies one DMA per
    run of blocks, no staging (None: wherever each block is one byte range; `CudaCopier`)."""
    if kv_cache.is_cuda:
        return CudaCopier(kv_cache, host_pool, staging_blocks, digest, direct)
    if isinstance(kv_cache, LayerTensors):
        return LayerCopier(kv_cache, host_pool, digest)
    return ThreadCopier(kv_cache, host_pool, copy_threads, digest)
