"""kvbridge's threads get every CPU the process may use, not the one core vLLM pins its worker to.

vLLM's CPU worker binds its main thread (and its OpenMP threads) to cores, and every thread that
thread starts inherits the binding: the NIXL and UCX progress threads, the side-channel server,
the handshake and lease pools, the offload copier. They then share one core with vLLM's worker,
which spins between steps (`sched_yield` in its shared-memory queue). Measured on a 2-core machine:
a P/D read that takes 0.5 s unbound missed its 30 s lease, and handshakes went unanswered.

`unpinned` widens the calling thread's CPU set for the duration of a call into kvbridge, so the
threads kvbridge starts inside it (eagerly or lazily, e.g. a pool's first job) are not bound; the
binding is restored on return. A thread that is not bound more narrowly pays one syscall.
"""

from __future__ import annotations

import contextlib
import functools
import os


@functools.cache
def _process_cpus() -> frozenset[int]:
    """CPUs this process may run on (its cgroup's effective cpuset, else all online CPUs)."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        if cpus:
            return frozenset(cpus)
    except (OSError, ValueError):
        pass
    return frozenset(range(os.cpu_count() or 1))


@contextlib.contextmanager
def unpinned():
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    current = os.sched_getaffinity(0)
    wide = _process_cpus()
    if current >= wide:
        yield
        return
    try:
        os.sched_setaffinity(0, wide)
    except OSError:  # a CPU went away or a policy forbids it: run bound, as vLLM set it
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, current)


def run_unpinned(method):
    """Decorator: the method runs `unpinned`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with unpinned():
            return method(*args, **kwargs)

    return wrapper
