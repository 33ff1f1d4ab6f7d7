"""Same-host GPU path: copy KV blocks to and from a peer engine's cache through a CUDA IPC mapping.

NIXL/UCX (cuda_ipc) pays ~15 µs per descriptor: on 2 × H200 a read of 202 scattered 2 MiB blocks
ran at ~0.25-0.38 of a raw peer copy (docs/benchmarks.md). When both engines' KV caches are on
GPUs of one host, the owner exports its KV tensor's CUDA IPC handle in the handshake and the
reader maps it once, in the context of its own GPU (the owner's GPU need not be visible to it,
e.g. under per-process CUDA_VISIBLE_DEVICES). A transfer of at least `min_runs` copies is then a
copy per byte range `descriptors.coalesce_blocks` gives (a run of blocks between block-major
caches; per layer or per page with strided ones), enqueued with `cuMemcpyBatchAsync` (CUDA ≥ 12.8
drivers; one `cuMemcpyAsync` per copy before) in batches of 16, 32, 64... on a dedicated stream,
and completed by a CUDA event.
Copy engines move the bytes: no SM is taken from the model.

Measured on 2 × H200, 202 runs of 2 MiB (benchmarks/ipc_copy_methods.py, transfer_bw.py): the
copies alone 0.99 of a raw peer copy (one batch: 0.86; one call per run: 0.67; a torch copy per
run: 0.26), a read through `KVEndpoint` 0.86-0.89. Few-run transfers measured faster through NIXL
inside the P/D engine, hence `min_runs` (KVEndpoint's `ipc_min_runs`).

Everything else stays as with NIXL: the same handshake (compatibility hash, version), leases and
the release that validates them, deadlines and failure reporting. The path is used
only when the owner runs on the same host (same boot id) in another process; any failure to map
falls back to NIXL. Talks to the CUDA driver (libcuda) through ctypes: no extra dependency.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import socket
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.errors import TransferError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.descriptors import coalesce_blocks
from kvbridge.transfer.messages import IpcExport

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


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]

    # Byte access goes through memory: c_char arrays read and assign as NUL-terminated strings.
    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), ctypes.sizeof(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> _IpcHandle:
        if len(data) != ctypes.sizeof(cls):
            raise TransferError(f"a CUDA IPC handle has {ctypes.sizeof(cls)} bytes, got {len(data)}")
        handle = cls()
        ctypes.memmove(ctypes.addressof(handle), data, len(data))
        return handle


class _MemLocation(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA 12.8)
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_SRC_ACCESS_ORDER_STREAM = 0x1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order
_LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
_u64, _size, _ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
FIRST_BATCH = 16  # copies in the first cuMemcpyBatchAsync of a transfer; see _Driver.copy


class _Driver:
    """The libcuda entry points this module uses. `memcpy_batch` is None on drivers before 12.8."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(_size), _u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), _u64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(_u64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [_u64]
        lib.cuMemcpyAsync.argtypes = [_u64, _u64, _size, _ptr]
        lib.cuStreamGetCtx.argtypes = [_ptr, ctypes.POINTER(_ptr)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_ptr)]
        lib.cuCtxPushCurrent_v2.argtypes = [_ptr]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(_ptr)]
        lib.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(_ptr), ctypes.c_int, _u64,
                                            ctypes.POINTER(ctypes.c_int)]
        self.lib = lib
        self.memcpy_batch, self._batch_has_fail_index = self._resolve_batch()

    def _resolve_batch(self):
        # cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs[, failIdx], stream):
        # CUDA 12.8 has the failIdx out-parameter, 13.0 dropped it; ask for the newest first.
        for version, has_fail_index in ((13000, False), (12080, True)):
            fn, status = _ptr(), ctypes.c_int()
            found = self.lib.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), version, 0, ctypes.byref(status))
            if found == 0 and fn.value:
                args = [_ptr, _ptr, _ptr, _size, _ptr, _ptr, _size] + [_ptr] * has_fail_index + [_ptr]
                return ctypes.CFUNCTYPE(ctypes.c_int, *args)(fn.value), has_fail_index
        return None, False

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, device: int,
             first_batch: int | None = FIRST_BATCH) -> None:
        """Enqueue copies srcs[i] -> dsts[i] of sizes[i] bytes on `stream` (uint64 arrays).

        Batched when the driver can: `first_batch` copies in one call, then batches twice as large
        as the one before, so the copy engines start after the first call instead of after all of
        them (each call costs ~45 µs + ~1 µs per copy, which the copies already queued then cover).
        None: everything in one call. Without the batch API, one driver call per copy. The calls
        run in `stream`'s context, whichever context is current on this thread.
        """
        with self._context_of(stream):
            if self.memcpy_batch is None:
                for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                    _check(self.lib.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")
                return
            here = _MemLocation(_LOCATION_DEVICE, device)  # hints; ignored for plain device memory
            attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, here, here, 0)
            first = _size(0)  # attrs[0] applies from a call's first copy on
            fail_index = [ctypes.addressof(_size())] if self._batch_has_fail_index else []
            start, count = 0, first_batch or len(sizes)
            while start < len(sizes):
                end = min(start + count, len(sizes))
                args = [dsts[start:].ctypes.data, srcs[start:].ctypes.data, sizes[start:].ctypes.data, end - start,
                        ctypes.addressof(attrs), ctypes.addressof(first), 1, *fail_index]
                _check(self.memcpy_batch(*args, stream), "cuMemcpyBatchAsync")
                start, count = end, 2 * count

    @contextlib.contextmanager
    def _context_of(self, stream: int):
        """Make `stream`'s context current for the block (a push/pop of ~1 µs, where
        torch.cuda.device costs tens of µs), unless it already is."""
        ctx, current = _ptr(), _ptr()
        _check(self.lib.cuStreamGetCtx(stream, ctypes.byref(ctx)), "cuStreamGetCtx")
        _check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if ctx.value == current.value:
            yield
            return
        _check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(_ptr()))


@functools.cache
def _driver() -> _Driver:
    return _Driver()


def _check(result: int, what: str) -> None:
    if result != 0:
        raise TransferError(f"CUDA driver call {what} failed with CUresult {result}")


def export_tensor(tensor: torch.Tensor) -> IpcExport | None:
    """The IPC export of a CUDA tensor's memory, or None for a CPU tensor or when the driver refuses
    (e.g. memory from expandable segments, which legacy IPC cannot export)."""
    import torch

    if not tensor.is_cuda:
        return None
    try:
        with torch.cuda.device(tensor.device):
            lib = _driver().lib
            base, size = _u64(), _size()
            _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()), "cuMemGetAddressRange")
            handle = _IpcHandle()
            _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    except (OSError, TransferError) as e:
        logger.info("no CUDA IPC export for the KV cache (%s); peers read it through NIXL", e)
        return None
    return IpcExport(
        host_id=host_id(), pid=os.getpid(), handle=handle.to_bytes(), offset=tensor.data_ptr() - base.value,
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

        handle = _IpcHandle.from_bytes(export.handle)
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # the primary context exists and is current on this thread
            ptr = _u64()
            _check(_driver().lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
            base, size = _u64(), _size()
            _check(_driver().lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr.value),
                   "cuMemGetAddressRange")
        self._base: int | None = ptr.value
        if export.offset < 0 or export.offset + export.nbytes > size.value:
            self.close()  # the exporter's claim does not fit the allocation it handed out
            raise TransferError(
                f"CUDA IPC export claims {export.nbytes} bytes at offset {export.offset} of a {size.value}-byte allocation"
            )
        self.addr = ptr.value + export.offset  # the peer's KV tensor, as a device pointer here
        self.nbytes = export.nbytes

    def close(self) -> None:
        """Unmap. The caller has synchronized every stream that used the mapping. Idempotent."""
        if self._base is None:
            return
        base, self._base = self._base, None
        _check(_driver().lib.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")


class IpcCopy:
    """A transfer through a mapping, in flight until `event` completes."""

    def __init__(self, event: torch.cuda.Event, num_runs: int) -> None:
        self.event = event
        self.num_runs = num_runs  # copies enqueued: byte ranges adjacent on both sides

    def is_done(self) -> bool:
        return self.event.query()


def copy_plan(
    op: str,
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
    if op not in ("READ", "WRITE"):
        raise ValueError(f"op must be 'READ' or 'WRITE', got {op!r}")
    ranges = coalesce_blocks(local_ids, remote_ids, local_layout, remote_layout)
    sizes = ranges.nbytes.astype(np.uint64)
    local = np.uint64(local_addr) + ranges.local_offsets.astype(np.uint64)
    remote = np.uint64(remote_addr) + ranges.remote_offsets.astype(np.uint64)
    return (local, remote, sizes) if op == "READ" else (remote, local, sizes)


class IpcCopier:
    """Copies blocks between the local GPU KV cache and mapped peer caches, on one dedicated stream."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, min_runs: int = 1) -> None:
        self.device = kv_cache.device
        self.min_runs = min_runs  # fewer runs: start() declines, NIXL moves it
        self._addr = kv_cache.data_ptr()
        self._layout = layout
        self._stream: torch.cuda.Stream | None = None  # made on first use
        self._ready: torch.cuda.Event | None = None
        self.num_copies = 0

    def start(
        self, op: str, mapping: IpcMapping, peer_layout: KVCacheLayout, local_ids: np.ndarray, remote_ids: np.ndarray
    ) -> IpcCopy | None:
        """Enqueue READ (peer -> local) or WRITE (local -> peer) of the paired blocks, after all work
        already queued on this device's current stream; None (nothing enqueued) for fewer than
        `min_runs` copies (runs of blocks between block-major caches)."""
        import torch

        dsts, srcs, sizes = copy_plan(op, self._addr, self._layout, local_ids, mapping.addr, peer_layout, remote_ids)
        if len(sizes) < self.min_runs:
            return None
        stream, ready = self._copy_stream()
        ready.record(torch.cuda.current_stream(self.device))  # work queued so far, e.g. the last reads
        stream.wait_event(ready)  # of blocks about to be overwritten, comes first
        try:
            _driver().copy(dsts, srcs, sizes, stream.cuda_stream, self.device.index)
        except TransferError:
            stream.synchronize()  # copies enqueued before the failure land before anyone reuses blocks
            raise
        done = torch.cuda.Event()
        done.record(stream)
        self.num_copies += 1
        return IpcCopy(done, len(sizes))

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
