"""Transfer metrics of the NixlConnector: counts, bytes, latency percentiles, and throughput.

Throughput is bytes over *wall time with a transfer in flight* (the union of the transfers'
[start, end] intervals), not over summed durations: eight concurrent 1-second reads of 1 GB are
8 GB/s, not 1 GB/s.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from kvbridge.connectors.latency import percentiles_ms

_WINDOW = 4096  # most recent transfers kept for percentiles and throughput


def busy_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of the intervals [starts[i], ends[i]]."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # furthest end seen so far
    # each interval adds what sticks out beyond everything that started before it
    prev_reach = np.concatenate(([starts[0]], reach[:-1]))
    return float(np.sum(np.clip(reach - np.maximum(starts, prev_reach), 0.0, None)))


class ReadTimes(NamedTuple):
    """One confirmed read, on the worker's clock (time.monotonic)."""

    posted: float  # the read was handed to NIXL (or the CUDA IPC copier)
    landed: float  # its bytes were in place
    confirmed: float  # the prefill engine said its lease held through the read: the blocks may be used


class TransferStats:
    def __init__(self) -> None:
        self.num_transfers = 0
        self.num_failures = 0
        self.num_load_errors = 0  # blocks reported as failed loads
        self.num_expired_reads = 0  # reads whose lease had expired: never served
        self.num_digest_mismatches = 0  # reads whose bytes differ from the prefill's digest: never served
        self.num_unverified_reads = 0  # reads the prefill sent no usable digest for: never served
        self.num_granted_reads = 0  # reads verified against the prefill's signed grant: no round trip
        self.num_sync_reads = 0  # of those, loaded in the step that scheduled them (sync_ipc_reads)
        self.num_refused_sync_reads = 0  # synchronous loads that could not be made: load errors in their step
        self.num_unusable_grants = 0  # grants refused (forged, stale, another lease): confirmed instead
        # decode, idle_step_wait_s: waits in steps that run no model, ended by a read's end / by the bound
        self.num_idle_step_waits_ended = 0
        self.num_idle_step_waits_timed_out = 0
        self.idle_step_wait_s = 0.0  # their total time
        self.num_digested_bytes = 0
        self._digest_s: deque[float] = deque(maxlen=_WINDOW)  # per verified read
        self.bytes_transferred = 0
        self.num_descriptors = 0
        self.last_read_descriptors = 0  # descriptors of the last completed read: its runs of blocks x layers
        self.max_read_descriptors = 0
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=_WINDOW)  # (start, end, nbytes)
        self._device: deque[tuple[float, int]] = deque(maxlen=_WINDOW)  # (seconds, nbytes) of device-timed reads
        self._grant_s: deque[float] = deque(maxlen=_WINDOW)  # prefill: digest and sign, per grant at finish
        self.last_error: str | None = None
        self._confirm_s: deque[float] = deque(maxlen=_WINDOW)  # landed -> confirmed, per read
        self.last_read: ReadTimes | None = None
        self.last_digest_s: float | None = None

    def record_done(
        self, start: float, end: float, nbytes: int, num_descriptors: int, device_s: float | None = None
    ) -> None:
        """One read done: posted at `start`, seen landed at `end`; `device_s`, where the read was timed
        on the device (a CUDA IPC copy), its copies' own time, waits before them excluded."""
        self.num_transfers += 1
        self.bytes_transferred += nbytes
        self.num_descriptors += num_descriptors
        self.last_read_descriptors = num_descriptors
        self.max_read_descriptors = max(self.max_read_descriptors, num_descriptors)
        self._recent.append((start, end, nbytes))
        if device_s is not None:
            self._device.append((device_s, nbytes))

    def record_grant(self, seconds: float) -> None:
        """Prefill: one lease digested and signed as its request finished (local_grants.py)."""
        self._grant_s.append(seconds)

    def record_confirmed(self, posted: float, landed: float, confirmed: float) -> None:
        self._confirm_s.append(confirmed - landed)
        self.last_read = ReadTimes(posted, landed, confirmed)

    def record_digest(self, seconds: float, nbytes: int) -> None:
        """One read's bytes digested on this node (what verification costs the decode)."""
        self._digest_s.append(seconds)
        self.num_digested_bytes += nbytes
        self.last_digest_s = seconds

    def recent(self) -> list[tuple[float, float, int]]:
        """(start, end, nbytes) of the most recent transfers, oldest first."""
        return list(self._recent)

    def record_failure(self, error: str) -> None:
        self.num_failures += 1
        self.last_error = error

    def as_dict(self) -> dict:
        recent = np.asarray(self._recent, dtype=np.float64).reshape(-1, 3)
        lat = recent[:, 1] - recent[:, 0]
        busy_s = busy_seconds(recent[:, 0], recent[:, 1])
        p50, p90, p99 = percentiles_ms(lat, (50, 90, 99))
        confirm_p50, confirm_p99 = percentiles_ms(self._confirm_s, (50, 99))
        digest_p50, digest_p99 = percentiles_ms(self._digest_s, (50, 99))
        grant_p50, grant_p99 = percentiles_ms(self._grant_s, (50, 99))
        device = np.asarray(self._device, dtype=np.float64).reshape(-1, 2)
        (device_p50,) = percentiles_ms(device[:, 0], (50,))
        device_s = float(device[:, 0].sum())
        return {
            "num_transfers": self.num_transfers,
            "num_failures": self.num_failures,
            "num_load_errors": self.num_load_errors,
            "num_expired_reads": self.num_expired_reads,
            "num_digest_mismatches": self.num_digest_mismatches,
            "num_unverified_reads": self.num_unverified_reads,
            "num_granted_reads": self.num_granted_reads,
            "num_sync_reads": self.num_sync_reads,
            "num_refused_sync_reads": self.num_refused_sync_reads,
            "num_unusable_grants": self.num_unusable_grants,
            "num_idle_step_waits_ended": self.num_idle_step_waits_ended,
            "num_idle_step_waits_timed_out": self.num_idle_step_waits_timed_out,
            "idle_step_wait_ms_total": self.idle_step_wait_s * 1e3,
            "num_digested_bytes": self.num_digested_bytes,
            "digest_ms_p50": digest_p50,
            "digest_ms_p99": digest_p99,
            "grant_ms_p50": grant_p50,
            "grant_ms_p99": grant_p99,
            # CUDA IPC reads timed on the device: the copies alone, none of the waits around them
            "device_read_ms_p50": device_p50,
            "device_read_gbps": float(device[:, 1].sum()) / device_s / 1e9 if device_s > 0 else 0.0,
            "bytes_transferred": self.bytes_transferred,
            "num_descriptors": self.num_descriptors,
            "last_read_descriptors": self.last_read_descriptors,
            "max_read_descriptors": self.max_read_descriptors,
            "last_error": self.last_error or "",
            "latency_ms_p50": p50,
            "latency_ms_p90": p90,
            "latency_ms_p99": p99,
            # bytes in place -> the prefill's word that the lease held (one side-channel round trip)
            "confirm_ms_p50": confirm_p50,
            "confirm_ms_p99": confirm_p99,
            # over the most recent transfers: bytes / wall time with at least one in flight
            "throughput_gbps": float(recent[:, 2].sum()) / busy_s / 1e9 if busy_s > 0 else 0.0,
        }
