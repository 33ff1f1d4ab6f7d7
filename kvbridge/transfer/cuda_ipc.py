"""Same-host GPU path: copy KV blocks to and from a peer engine's cache through a CUDA IPC mapping.

NIXL/UCX (cuda_ipc) pays a fixed cost per descriptor, so a read of many scattered blocks runs far
below a raw peer copy (docs/benchmarks.md, "The CUDA IPC path", has the figures). When both
engines' KV caches are on GPUs of one host, the owner exports its KV tensor's CUDA IPC handle in the handshake and the
reader maps it once, in the context of its own GPU (the owner's GPU need not be visible to it,
e.g. under per-process CUDA_VISIBLE_DEVICES). A transfer of at least `min_runs` copies is then a
copy per byte range `descriptors.coalesce_blocks` gives (a run of blocks between block-major
caches; per layer or per page with strided ones), enqueued with `cuMemcpyBatchAsync` (CUDA ≥ 12.8
drivers; one `cuMemcpyAsync` per copy before) in batches of 16, 32, 64... on a dedicated stream,
and completed by a CUDA event.
Copy engines move the bytes: no SM is taken from the model. The exception is a read from a peer on
this very GPU (`sm_reads`, with Triton): there the mapped copies reached 0.55 TB/s at best against
1.9 TB/s for a plain device copy of the same 512 MiB (H200, `pd_transfer-h200`), so one kernel copies
the blocks on the SMs and digests (wsum64) the bytes it wrote from the registers that wrote them
(`digest.copy_blocks_with_digests`): the reader's check of the read costs no second pass.

Batches that grow were measured closest to a raw peer copy of every way to issue the copies
(`benchmarks/ipc_copy_methods.py`), and transfers of few runs faster through NIXL inside the P/D
engine, hence `min_runs` (KVEndpoint's `ipc_min_runs`); docs/benchmarks.md has the figures.

Everything else stays as with NIXL: the same handshake (compatibility hash, version), leases and
the release that validates them, deadlines and failure reporting. The path is used
only when the owner runs on the same host (same boot id) in another process; any failure to map
falls back to NIXL. The driver calls (IPC handles, mappings, batched copies) are `cuda_driver.py`'s.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import TransferError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.cuda_driver import IpcHandle, driver
from kvbridge.transfer.descriptors import coalesce_blocks
from kvbridge.transfer.digest import DigestJob, copy_blocks_with_digests, has_wsum_kernel, region_bytes
from kvbridge.transfer.messages import IpcExport
from kvbridge.transfer.options import TransferOp

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@functools.cache
def host_id() -> str:
    """Identifies this host across processes: the kernel's boot id (hostname where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def export_tensor(tensor: torch.Tensor) -> IpcExport | None:
    """The IPC export of a CUDA tensor's memory, or None for a CPU tensor or when the driver refuses
    (e.g. memory from expandable segments, which legacy IPC cannot export)."""
    import torch

    if not tensor.is_cuda:
        return None
    try:
        with torch.cuda.device(tensor.device):
            base, _ = driver().address_range(tensor.data_ptr())
            handle = driver().ipc_get_handle(base)
    except (OSError, TransferError) as e:
        logger.info("no CUDA IPC export for the KV cache (%s); peers read it through NIXL", e)
        return None
    return IpcExport(
        host_id=host_id(), pid=os.getpid(), handle=handle.to_bytes(), offset=tensor.data_ptr() - base,
        nbytes=tensor.numel() * tensor.element_size(), device_uuid=str(torch.cuda.get_device_properties(tensor.device).uuid),
    )


def can_map(export: IpcExport | None) -> bool:
    """An export from another process on this host (this process uses its own tensors directly)."""
    return export is not None and export.host_id == host_id() and export.pid != os.getpid()


class IpcMapping:
    """A peer's KV tensor mapped into this process, in the context of the local GPU `device`.

    The driver enables peer access from `device` to the GPU holding the memory, which need not be
    visible to this process. `close()` unmaps.
    """

    def __init__(self, export: IpcExport, device: torch.device) -> None:
        import torch

        handle = IpcHandle.from_bytes(export.handle)
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # the primary context exists and is current on this thread
            ptr = driver().ipc_open(handle)
            _, size = driver().address_range(ptr)
        self._base: int | None = ptr
        if export.offset < 0 or export.offset + export.nbytes > size:
            self.close()  # the exporter's claim does not fit the allocation it handed out
            raise TransferError(
                f"CUDA IPC export claims {export.nbytes} bytes at offset {export.offset} of a {size}-byte allocation"
            )
        self.addr = ptr + export.offset  # the peer's KV tensor, as a device pointer here
        self.nbytes = export.nbytes
        self.device = device
        self.same_device = export.device_uuid == str(torch.cuda.get_device_properties(device).uuid)
        self._bytes: torch.Tensor | None = None

    def region_bytes(self) -> torch.Tensor:
        """The mapped bytes as a [nbytes] uint8 tensor (no copy, no ownership: valid until `close`)."""
        import torch

        if self._base is None:
            raise TransferError("CUDA IPC mapping used after it was closed")
        if self._bytes is None:
            self._bytes = torch.as_tensor(_DeviceBytes(self.addr, self.nbytes), device=self.device)
        return self._bytes

    def close(self) -> None:
        """Unmap. The caller has synchronized every stream that used the mapping. Idempotent."""
        if self._base is None:
            return
        base, self._base, self._bytes = self._base, None, None
        driver().ipc_close(base)


class _DeviceBytes:
    """`nbytes` bytes of device memory at `addr`, as torch reads a foreign buffer (CUDA array interface)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


class IpcCopy:
    """A transfer through a mapping, in flight until `event` completes. `began` is recorded on the
    copy stream once the work it waits for is done, so `device_seconds` is the copies' own time.
    `digests`: a read on the SMs, the wsum64 digests of the blocks it wrote (in local id order)."""

    def __init__(self, began: torch.cuda.Event, event: torch.cuda.Event, num_runs: int,
                 digests: DigestJob | None = None) -> None:  # fmt: skip
        self.began = began
        self.event = event
        self.num_runs = num_runs  # copies enqueued: byte ranges adjacent on both sides (one kernel on the SMs)
        self.digests = digests

    def is_done(self) -> bool:
        return self.event.query()

    def device_seconds(self) -> float:
        """The copies' time on the device, first copy's start to last copy's end (once done)."""
        return self.began.elapsed_time(self.event) / 1e3


def copy_plan(
    op: TransferOp | str,
    local_addr: int,
    local_layout: KVCacheLayout,
    local_ids: np.ndarray,  # [n] int64
    remote_addr: int,
    remote_layout: KVCacheLayout,
    remote_ids: np.ndarray,  # [n] int64
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dsts, srcs, sizes) [R] uint64: one copy per byte range adjacent on both sides
    (`descriptors.coalesce_blocks`: a run of blocks between block-major caches), READ
    (remote -> local) or WRITE (local -> remote). Raises IndexError for an id outside a layout."""
    op = TransferOp(op)  # ValueError for anything else
    ranges = coalesce_blocks(local_ids, remote_ids, local_layout, remote_layout)
    sizes = ranges.nbytes.astype(np.uint64)
    local = np.uint64(local_addr) + ranges.local_offsets.astype(np.uint64)
    remote = np.uint64(remote_addr) + ranges.remote_offsets.astype(np.uint64)
    return (local, remote, sizes) if op is TransferOp.READ else (remote, local, sizes)


class IpcCopier:
    """Copies blocks between the local GPU KV cache and mapped peer caches, on one dedicated stream.

    `sm_reads`: a read from a peer on this very GPU runs as one kernel on the SMs (with Triton), which
    also digests the blocks it wrote (the copy's `digests`)."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, min_runs: int = 1, sm_reads: bool = True) -> None:
        self.device = kv_cache.device
        self.min_runs = min_runs  # fewer runs: start() declines, NIXL moves it
        self._addr = kv_cache.data_ptr()
        self._layout = layout
        self._region = region_bytes(kv_cache, layout)
        self.sm_reads = sm_reads and has_wsum_kernel() and kv_cache.is_cuda
        self._stream: torch.cuda.Stream | None = None  # made on first use
        self._ready: torch.cuda.Event | None = None
        self.num_copies = 0
        self.num_sm_reads = 0
        if self.sm_reads:
            self._compile_read_kernel()

    def _compile_read_kernel(self) -> None:
        """Triton compiles a kernel at its first launch (a second or more): do it now, not inside the first
        read. Block 0 copied onto itself, the layouts of a peer like us: the same bytes, the same kernel.
        A kernel that cannot be built here leaves same-GPU reads to the copy engines, named in the log."""
        import torch

        stream, _ = self._copy_stream()
        try:
            with torch.cuda.stream(stream):
                copy_blocks_with_digests(self._region, self._layout, [0], self._region, self._layout, [0]).result()
        except Exception as e:  # noqa: BLE001 - Triton and its compilers raise many kinds; none may stop the node
            self.sm_reads = False
            logger.warning("same-GPU KV reads go through the copy engines: the SM copy kernel cannot run here (%s: %s)",
                           type(e).__name__, e)  # fmt: skip

    def start(
        self, op: TransferOp, mapping: IpcMapping, peer_layout: KVCacheLayout, local_ids: np.ndarray, remote_ids: np.ndarray
    ) -> IpcCopy | None:
        """Enqueue READ (peer -> local) or WRITE (local -> peer) of the paired blocks, after all work
        already queued on this device's current stream; None (nothing enqueued) for fewer than
        `min_runs` copies (runs of blocks between block-major caches), unless the peer's cache is on
        this very GPU: NIXL/UCX moves such a read through host staging, hundreds of times slower."""

        if self.sm_reads and TransferOp(op) is TransferOp.READ and mapping.same_device:
            source = self._mapped_source(mapping, peer_layout)
            if source is not None:
                return self._read_on_sms(source, peer_layout, local_ids, remote_ids)
        dsts, srcs, sizes = copy_plan(op, self._addr, self._layout, local_ids, mapping.addr, peer_layout, remote_ids)
        if len(sizes) < self.min_runs and not mapping.same_device:
            return None

        def enqueue(stream: torch.cuda.Stream) -> None:
            try:
                driver().copy(dsts, srcs, sizes, stream.cuda_stream, self.device.index)
            except TransferError:
                stream.synchronize()  # copies enqueued before the failure land before anyone reuses blocks
                raise

        began, done, _ = self._on_copy_stream(enqueue)
        return IpcCopy(began, done, len(sizes))

    def _on_copy_stream(self, enqueue):
        """(began, done, what `enqueue(stream)` returned): its work on the dedicated stream, after all work
        already queued on this device's current stream, between two timing events."""
        import torch

        stream, ready = self._copy_stream()
        ready.record(torch.cuda.current_stream(self.device))  # work queued so far, e.g. the last reads
        stream.wait_event(ready)  # of blocks about to be overwritten, comes first
        began = torch.cuda.Event(enable_timing=True)
        began.record(stream)
        result = enqueue(stream)
        done = torch.cuda.Event(enable_timing=True)
        done.record(stream)
        self.num_copies += 1
        return began, done, result

    def _mapped_source(self, mapping: IpcMapping, peer_layout: KVCacheLayout) -> torch.Tensor | None:
        """The peer's KV region, as its layout claims it, for a read on the SMs. The claim is the peer's own:
        one that reaches past the bytes it exported is refused, never read. None (and the copy engines from
        now on, named in the log) where torch cannot see the mapped memory as a tensor."""
        if peer_layout.region_nbytes > mapping.nbytes:
            raise TransferError(f"the peer's KV layout spans {peer_layout.region_nbytes} bytes, past the "
                                f"{mapping.nbytes} bytes it exported")  # fmt: skip
        try:
            return mapping.region_bytes()[: peer_layout.region_nbytes]
        except (RuntimeError, TypeError, ValueError) as e:
            self.sm_reads = False
            logger.warning("same-GPU KV reads go through the copy engines: torch cannot read the mapped KV (%s: %s)",
                           type(e).__name__, e)  # fmt: skip
            return None

    def _read_on_sms(self, source: torch.Tensor, peer_layout: KVCacheLayout, local_ids: np.ndarray,
                     remote_ids: np.ndarray) -> IpcCopy:  # fmt: skip
        """READ as one kernel on the SMs that copies every block of `source` (the peer's region) and
        digests what it wrote."""
        import torch

        def enqueue(stream: torch.cuda.Stream):
            with torch.cuda.stream(stream):
                return copy_blocks_with_digests(source, peer_layout, remote_ids, self._region, self._layout, local_ids)

        began, done, digests = self._on_copy_stream(enqueue)
        self.num_sm_reads += 1
        return IpcCopy(began, done, 1, digests)

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _copy_stream(self) -> tuple[torch.cuda.Stream, torch.cuda.Event]:
        """The dedicated stream, and an event reused to order it after the current stream."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._ready = torch.cuda.Event()
        return self._stream, self._ready
