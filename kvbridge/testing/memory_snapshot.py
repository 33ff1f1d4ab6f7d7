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
import weakref
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


def live_tensors() -> list[torch.Tensor]:
    """torch.Tensor objects (parameters included) the garbage collector can see. Runs gc first."""
    gc.collect()
    # type(), not isinstance(): isinstance reads `obj.__class__`, which some module proxies
    # (deprecated torch attributes, dead weakref proxies) turn into warnings or errors.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def count_live_tensors() -> int:
    """How many `live_tensors()` there are."""
    return len(live_tensors())


def _entries(directory: str) -> dict[str, str]:
    """Entry name -> what it is (a thread's name, an fd's target); empty where /proc is missing."""
    found = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        try:
            if directory.endswith("task"):
                with open(f"{directory}/{name}/comm") as f:
                    found[name] = f.read().strip()
            else:
                found[name] = os.readlink(f"{directory}/{name}")
        except OSError:  # gone meanwhile (the listing's own fd, a thread that ended)
            continue
    return found


@dataclass(frozen=True)
class Census:
    """What this process holds, by identity: live tensors, OS threads, open file descriptors.

    `leaked(before, mid)`, on the census after two identical cycles of work (`before` taken before
    the first, `mid` between them), names what the second cycle left behind beyond what it released
    of the first's. Identity, not counts, so that objects released elsewhere meanwhile cannot hide a
    leak; net of the first cycle's, so that a cache the work refills (a process-wide tier whose
    blocks each cycle replaces) is not one.
    """

    tensors: dict[int, weakref.ref]  # id -> weak reference to that tensor
    threads: dict[str, str]  # thread id -> its name (/proc/self/task/*/comm)
    fds: dict[str, str]  # fd number -> what it points at (a file, "socket:[...]", "pipe:[...]")
    new_tensors: dict[int, weakref.ref]  # those of `tensors` not alive at the census given as `since`

    @classmethod
    def take(cls, since: Census | None = None) -> Census:
        tensors = {id(t): weakref.ref(t) for t in live_tensors()}
        new = {k: r for k, r in tensors.items() if since is not None and _is_new(k, r, since.tensors)}
        return cls(tensors, _entries("/proc/self/task"), _entries("/proc/self/fd"), new)

    def leaked(self, before: Census, mid: Census) -> dict[str, list[str]]:
        """"tensors" / "threads" / "fds" -> descriptions of what leaked (only kinds that did).
        `mid` must have been taken with `since=before`."""
        found = {}
        first = mid.new_tensors  # the first cycle's, as they were when it ended
        last = [t for k, r in self.tensors.items() if (t := r()) is not None and _is_new(k, r, mid.tensors)]
        if (net := len(last) - sum(r() is None for r in first.values())) > 0:
            found["tensors"] = [f"{tuple(t.shape)} {t.dtype}" for t in last][-net:]
        for kind in ("threads", "fds"):
            now, then, earlier = getattr(self, kind), getattr(mid, kind), getattr(before, kind)
            first_keys = {k for k, v in then.items() if earlier.get(k) != v}
            last_items = [v for k, v in now.items() if then.get(k) != v]
            if (net := len(last_items) - sum(1 for k in first_keys if now.get(k) != then[k])) > 0:
                found[kind] = sorted(last_items)[:net]
        return found


def _is_new(key: int, ref: weakref.ref, earlier: dict[int, weakref.ref]) -> bool:
    """The tensor `ref` points at is alive and was not in `earlier` (an id alone may be reused)."""
    obj, old = ref(), earlier.get(key)
    return obj is not None and (old is None or old() is not obj)


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
