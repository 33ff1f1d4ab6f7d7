"""Memory snapshots: what the process holds on the device and on the host, for shutdown tests.
Part of the conformance kit (a connector's shutdown gives back every byte, thread and file
descriptor) and used by kvbridge's own shutdown tests.

    before = take_snapshot("cuda")
    ... create an engine, generate, shut it down ...
    after = take_snapshot("cuda")
    assert after.cuda_allocated == before.cuda_allocated

`wait_for_device_memory` covers drivers (ROCm, some CUDA set-ups) that give VRAM back to
`mem_get_info` a little after the tensors were freed.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from dataclasses import dataclass

import torch

from kvbridge.transfer.progress import drive_until


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading. CUDA fields are None when no CUDA device was asked for or none is present."""

    cuda_allocated: int | None  # torch.cuda.memory_allocated: bytes in live tensors
    cuda_reserved: int | None  # torch.cuda.memory_reserved: bytes held by the caching allocator
    cuda_free: int | None  # mem_get_info()[0]: free device memory, every process included
    cuda_total: int | None  # mem_get_info()[1]
    rss_bytes: int  # resident set size of this process
    num_live_tensors: int  # torch.Tensor objects reachable by the garbage collector
    num_threads: int | None = None  # OS threads of this process (native ones included); None where unknown
    num_fds: int | None = None  # open file descriptors (sockets, pipes, files); None where unknown

    @property
    def cuda_used(self) -> int | None:
        """Device memory in use by anyone (total - free)."""
        if self.cuda_free is None or self.cuda_total is None:
            return None
        return self.cuda_total - self.cuda_free

    def diff(self, earlier: MemorySnapshot) -> dict[str, int | None]:
        """Field-by-field `self - earlier` (None where either is None), for assertion messages."""
        out: dict[str, int | None] = {}
        for name in ("cuda_allocated", "cuda_reserved", "cuda_used", "rss_bytes", "num_live_tensors",
                     "num_threads", "num_fds"):
            a, b = getattr(self, name), getattr(earlier, name)
            out[name] = None if a is None or b is None else a - b
        return out


def rss_bytes() -> int:
    """Current resident set size, from /proc/self/statm; peak RSS (getrusage) where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _count_entries(directory: str) -> int | None:
    try:
        return len(os.listdir(directory))
    except OSError:  # no /proc (macOS): not measured
        return None


def count_threads() -> int | None:
    """OS threads of this process, native ones (UCX, OpenMP, a connector's C library) included."""
    return _count_entries("/proc/self/task")


def count_fds() -> int | None:
    """Open file descriptors of this process (the count includes the one listing them)."""
    return _count_entries("/proc/self/fd")


def count_live_tensors() -> int:
    """torch.Tensor objects (parameters included) the garbage collector can see. Runs gc first."""
    gc.collect()
    # type(), not isinstance(): isinstance reads `obj.__class__`, which some module proxies
    # (deprecated torch attributes, dead weakref proxies) turn into warnings or errors.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    dev = torch.device(device)
    return dev if dev.type == "cuda" and torch.cuda.is_available() else None


def take_snapshot(device: torch.device | str | None = None) -> MemorySnapshot:
    """Snapshot of `device` (default: the current CUDA device if any) and of this process."""
    cuda = _cuda_device(device)
    allocated = reserved = free = total = None
    if cuda is not None:
        torch.cuda.synchronize(cuda)
        allocated = torch.cuda.memory_allocated(cuda)
        reserved = torch.cuda.memory_reserved(cuda)
        free, total = torch.cuda.mem_get_info(cuda)
    return MemorySnapshot(allocated, reserved, free, total, rss_bytes(), count_live_tensors(), count_threads(), count_fds())


def wait_for_device_memory(
    threshold_bytes: int, timeout_s: float, device: torch.device | str | None = None, poll_s: float = 0.05
) -> int:
    """Poll `mem_get_info` until used device memory (total - free) is at most `threshold_bytes`.

    Returns the used bytes seen last. Raises TimeoutError naming both figures after `timeout_s`.
    Without a CUDA device there is nothing to wait for: returns 0 at once.
    """
    cuda = _cuda_device(device)
    if cuda is None:
        return 0
    used = 0

    def settled() -> bool:
        nonlocal used
        free, total = torch.cuda.mem_get_info(cuda)
        used = total - free
        return used <= threshold_bytes

    if drive_until(settled, time.monotonic() + timeout_s, first_wait_s=poll_s, max_wait_s=poll_s):
        return used
    raise TimeoutError(
        f"device {cuda} still uses {used} bytes after {timeout_s}s (threshold {threshold_bytes}); "
        "something still holds device memory: check live tensors and other processes"
    )
