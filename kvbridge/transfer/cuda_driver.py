"""The CUDA driver (libcuda) entry points kvbridge calls, through ctypes: no extra dependency.

Only what the same-host GPU path (`cuda_ipc.py`) needs: legacy IPC handles (export, open, close),
address ranges, and asynchronous copies, batched with `cuMemcpyBatchAsync` where the driver has it
(CUDA >= 12.8) and one `cuMemcpyAsync` per copy before. Every failed call raises TransferError
naming the call and its CUresult. The library is loaded on first use (`driver()`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import numpy as np

from kvbridge.errors import TransferError


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]

    # Byte access goes through memory: c_char arrays read and assign as NUL-terminated strings.
    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), ctypes.sizeof(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
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
FIRST_BATCH = 16  # copies in the first cuMemcpyBatchAsync of a transfer; see CudaDriver.copy


class CudaDriver:
    """The libcuda entry points kvbridge uses. `memcpy_batch` is None on drivers before 12.8."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(_size), _u64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), _u64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(_u64), IpcHandle, ctypes.c_uint]
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

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding device pointer `ptr`."""
        base, size = _u64(), _size()
        check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_get_handle(self, base: int) -> IpcHandle:
        """The IPC handle of the allocation starting at `base` (in the current context)."""
        handle = IpcHandle()
        check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return handle

    def ipc_open(self, handle: IpcHandle) -> int:
        """Map another process's allocation into the current context (peer access enabled lazily)."""
        ptr = _u64()
        check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        check(self.lib.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        """One copy on `stream`, in the current context."""
        check(self.lib.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")

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
                    check(self.lib.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")
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
                check(self.memcpy_batch(*args, stream), "cuMemcpyBatchAsync")
                start, count = end, 2 * count

    @contextlib.contextmanager
    def _context_of(self, stream: int):
        """Make `stream`'s context current for the block (a push/pop of ~1 µs, where
        torch.cuda.device costs tens of µs), unless it already is."""
        ctx, current = _ptr(), _ptr()
        check(self.lib.cuStreamGetCtx(stream, ctypes.byref(ctx)), "cuStreamGetCtx")
        check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if ctx.value == current.value:
            yield
            return
        check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(_ptr()))


@functools.cache
def driver() -> CudaDriver:
    """The process's one CudaDriver; raises OSError where libcuda cannot be loaded."""
    return CudaDriver()


def check(result: int, what: str) -> None:
    if result != 0:
        raise TransferError(f"CUDA driver call {what} failed with CUresult {result}")
