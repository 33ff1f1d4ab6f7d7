"""The shutdown tests' import path for `kvbridge.testing.memory_snapshot`, which the conformance kit ships."""

from kvbridge.testing.memory_snapshot import (  # noqa: F401
    MemorySnapshot,
    count_fds,
    count_live_tensors,
    count_threads,
    rss_bytes,
    take_snapshot,
    wait_for_device_memory,
)
