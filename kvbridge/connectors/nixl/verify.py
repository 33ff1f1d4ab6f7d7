"""Decode side: a read is used only when its bytes are the bytes the prefill leased.

The prefill digests each leased block when it grants the lease and returns the digests with
`released` (transfer/digest.py). `ReadVerifier` digests the blocks this node read, on this node's
device, and compares:

    landed --start(job)--> digest queued with the algorithm the prefill named in its handshake
    released + digests --verify(job, digest)--> None: use the blocks | why not: a load error

`start` runs as soon as a read lands, while its confirmation is on the network; `verify` waits for
that digest (or computes it, when the prefill's answer names another algorithm or its handshake
named none). No digest in the answer, digests that do not cover the lease, or any mismatch is a
load error: counted (`num_unverified_reads`, `num_digest_mismatches`) and named by the caller's log.

Engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvbridge.connectors.nixl.metadata import RecvJob
from kvbridge.connectors.nixl.stats import TransferStats
from kvbridge.transfer import messages as m
from kvbridge.transfer.digest import ALGORITHMS, DigestError, DigestJob, mismatches

if TYPE_CHECKING:
    from kvbridge.transfer.endpoint import KVEndpoint


class ReadVerifier:
    def __init__(self, endpoint: KVEndpoint, stats: TransferStats, clock: Callable[[], float]) -> None:
        self._endpoint, self._stats, self._clock = endpoint, stats, clock
        # req id -> (digests of its landed blocks per rank of the peer node (endpoint.start_read_digests), time spent)
        self._started: dict[str, tuple[list[list[tuple[int | None, DigestJob]]], float]] = {}

    def start(self, job: RecvJob, copied: DigestJob | None = None) -> None:
        """Digest a landed read's blocks with the algorithm the prefill said it uses (handshake).
        `copied`: the digests of the blocks its copy wrote, taken by the copy itself (a read on the
        SMs, in local block order); used when they are of that algorithm and of the whole blocks."""
        peers = self._endpoint.peers
        if not job.local_block_ids or job.remote.address not in peers:
            return
        peer = peers.get(job.remote.address)
        alg = peer.digest_alg
        if alg not in ALGORITHMS:
            return  # an older prefill: digested once its answer names the algorithm
        if copied is not None and copied.alg == alg and not self._endpoint.is_translated(peer):
            self._started[job.request_id] = ([[(None, copied)]], 0.0)
            return
        start = self._clock()
        try:
            started = self._endpoint.start_read_digests(job.remote.address, job.local_block_ids, job.remote_block_ids, alg)
        except DigestError:
            return  # tried again, and refused with a reason, when the answer comes
        self._started[job.request_id] = (started, self._clock() - start)

    def has_started(self, req_id: str) -> bool:
        """Whether the landed read's digest was taken (queued on its device, or computed)."""
        return req_id in self._started

    def verify(self, job: RecvJob, digest: m.KVDigest | None) -> str | None:
        """None when the blocks read hold the bytes the prefill digested when it granted the lease;
        otherwise why not (the read is a load error)."""
        started, spent_s = self._started.pop(job.request_id, (None, 0.0))
        if not job.local_block_ids:
            return None
        who = f"engine {job.remote.engine_id} at {job.remote.address}"
        num_read = len(job.remote_block_ids)  # the prefill's blocks (as many as ours unless layouts are translated)
        if digest is None:
            self._stats.num_unverified_reads += 1
            return (
                f"{who} confirmed the read but sent no digest of its blocks (an older build, or verify_kv_digest "
                "off there); this node uses only verified KV (NixlConnector option verify_kv_digest)"
            )
        per_rank = [digest, *digest.ranks]  # a TP peer node: every rank's digests of its own heads
        num_ranks = 1 + len(self._endpoint.peers.get(job.remote.address).ranks) if job.remote.address in self._endpoint.peers else 1
        num_leased = len(job.lease.block_ids)
        if len(per_rank) != num_ranks or any(
            len(values) != num_leased for d in per_rank for values in (d.values, *d.head_values)
        ):  # fmt: skip
            self._stats.num_unverified_reads += 1
            return f"{who} sent digests of {[len(d.values) for d in per_rank]} blocks per rank for a lease of {num_leased} blocks on {num_ranks} ranks"
        start = self._clock()
        try:
            if started is None or any(j.alg != digest.alg for jobs in started for _, j in jobs):
                started = self._endpoint.start_read_digests(
                    job.remote.address, job.local_block_ids, job.remote_block_ids, digest.alg
                )
            got = [[(index, j.result()) for index, j in jobs] for jobs in started]
        except DigestError as e:
            self._stats.num_unverified_reads += 1
            return f"cannot verify the blocks read from {who}: {e}"
        self._stats.record_digest(spent_s + self._clock() - start, len(job.local_block_ids) * self._endpoint.layout.block_nbytes)
        for rank, (sent, got_rank) in enumerate(zip(per_rank, got)):
            for index, got_part in got_rank:  # nothing for a rank none of whose heads are ours: nothing was read from it
                if index is None:
                    values = sent.values  # its whole pages
                elif index < len(sent.head_values):
                    values = sent.head_values[index]
                else:
                    self._stats.num_unverified_reads += 1
                    return (f"{who} sent no digest of its TP rank {rank}'s KV head {index}, which this node read, and this "
                            "node uses only verified KV: the prefill node runs with the NixlConnector option "
                            '"digest_kv_heads": false (or is an older build); unset it where readers run a wider '
                            "tensor parallelism than it")
                expected = values[job.lease_offset : job.lease_offset + num_read]
                bad = mismatches(m.KVDigest(alg=digest.alg, values=expected), got_part)
                if bad:
                    break
            else:
                continue
            self._stats.num_digest_mismatches += 1
            i = bad[0]
            return (
                f"KV DIGEST MISMATCH: {len(bad)} of {num_read} blocks read from {who} (its TP rank {rank}) do not hold the "
                f"bytes it leased (first: remote block {job.remote_block_ids[i]}, read into local blocks "
                f"{list(job.local_block_ids)}, {digest.alg}); they were corrupted in flight or written after the lease was granted"
            )
        return None

    def forget(self, req_id: str) -> None:
        """The read ended without a verdict (failed, expired): drop its digest."""
        self._started.pop(req_id, None)
