"""Worker half of the NixlConnector: moves the bytes, next to the KV cache tensor.

Decode (reader), per request:

    RecvJob --read_blocks--> HANDSHAKING --> POSTED --> DONE --TransferDone--> released: finished_recving
                                  |             |                  '--------> expired:  load error
                                  '-------------'--> FAILED | EXPIRED -------------------> load error

A load error reports the job's blocks in `get_block_ids_with_load_errors` together with the request
in `finished_recving`; the scheduler then recomputes them or fails the request (policy). Nothing
waits without a deadline: the endpoint's tracker expires handshakes and reads, and side-channel
requests have their own timeouts.

Prefill (owner), per request: the scheduler's plan grants a lease on the held blocks; the
side-channel thread renews or releases it; `get_finished` reports released and expired leases in
`finished_sending` so the scheduler frees the blocks.

NIXL is touched only from the engine thread (`KVEndpoint` rule). Side-channel requests to a peer
(TransferDone, LeaseRenew) block, so they run on one helper thread per peer address.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.connectors.base import ConnectorContext, FinishedTransfers, FlushResult
from kvbridge.connectors.nixl.leases import LeaseTable
from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata, RecvJob
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.scheduler import SIDE_CHANNEL_PORT_STAT
from kvbridge.connectors.nixl.stats import TransferStats
from kvbridge.transfer import messages as m

if TYPE_CHECKING:
    import torch

    from kvbridge.config import KVTransferConfig
    from kvbridge.layout import KVCacheLayout
    from kvbridge.transfer.endpoint import KVEndpoint

logger = logging.getLogger(__name__)


@dataclass
class _PeerControl:
    """Side-channel traffic to one prefill engine: batched, one request in flight at a time."""

    executor: ThreadPoolExecutor
    done_ok: list[str] = field(default_factory=list)  # local request ids read successfully
    done_failed: list[str] = field(default_factory=list)  # local request ids whose read failed
    in_flight: tuple[Future, list[str]] | None = None  # (future, local ids it covers)
    renewing: Future | None = None
    last_renew: float = 0.0


class NixlWorker:
    def __init__(self, config: KVTransferConfig, context: ConnectorContext, options: NixlOptions) -> None:
        self.config = config
        self.context = context
        self.options = options
        self.stats = TransferStats()
        self._clock = time.monotonic
        self._endpoint: KVEndpoint | None = None
        self._leases = LeaseTable(options.lease_s)
        self._recvs: dict[str, RecvJob] = {}  # live and releasing reads, by local request id
        self._peers: dict[str, _PeerControl] = {}  # by side-channel address
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._is_shut_down = False

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        from kvbridge.transfer.endpoint import KVEndpoint  # imports nixl

        if self._endpoint is not None:
            raise RuntimeError("NixlConnector: register_kv_caches called twice")
        opts = self.options
        self._endpoint = KVEndpoint(
            self.config.engine_id,
            self.context.model_id,
            kv_cache,
            layout,
            host=self.config.side_channel_host,
            port=self.config.side_channel_port,
            serve=self.config.is_producer,
            backend=opts.backend,
            backend_params=opts.backend_params,
            message_handler=self._on_message if self.config.is_producer else None,
            descriptor_mode=opts.descriptor_mode,
            handshake_timeout_s=opts.handshake_timeout_s,
            handshake_retries=opts.handshake_retries,
            transfer_timeout_s=opts.transfer_timeout_s,
            cuda_ipc=opts.cuda_ipc,
            ipc_min_runs=opts.ipc_min_runs,
        )
        if self._endpoint.server is not None:
            logger.info("NixlConnector %s serving KV on %s", self.config.engine_id, self._endpoint.address)

    @property
    def side_channel_port(self) -> int | None:
        server = self._endpoint.server if self._endpoint is not None else None
        return server.port if server is not None else None

    # ------------------------------------------------------------------ prefill: side-channel thread

    def _on_message(self, msg: m.Message) -> m.Message:
        match msg:
            case m.LeaseRenew(req_ids=req_ids):
                held, unknown = self._leases.renew(req_ids, self._clock())
                return m.LeaseRenewReply(held=held, unknown=unknown)
            case m.TransferDone(req_ids=ok, failed_req_ids=failed):
                released, expired = self._leases.release(list(ok) + list(failed))
                return m.TransferDoneReply(released=released, expired=expired)
            case _:
                return m.ErrorReply(code=m.ErrorCode.UNSUPPORTED, message=f"{type(msg).__name__} is not handled here")

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, metadata: NixlConnectorMetadata | None) -> None:
        if metadata is None:
            return
        now = self._clock()
        for req_id, block_ids in metadata.leases.items():
            self._leases.grant(req_id, block_ids, now)
        for job in metadata.recvs.values():
            self._start_recv(job)

    def _start_recv(self, job: RecvJob) -> None:
        self._recvs[job.request_id] = job
        peer = self._peer(job.remote.address)
        if not job.local_block_ids:  # everything hit locally: only release the prefill's blocks
            peer.done_ok.append(job.request_id)
            return
        self._endpoint.read_blocks(job.request_id, job.remote.address, job.local_block_ids, job.remote_block_ids)
        peer.last_renew = peer.last_renew or self._clock()

    def _peer(self, address: str) -> _PeerControl:
        if address not in self._peers:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-nixl-peer")
            self._peers[address] = _PeerControl(executor)
        return self._peers[address]

    def wait_for_save(self, metadata: NixlConnectorMetadata | None) -> None:
        pass  # prefill never writes: the decode side reads the blocks while they are leased

    def get_finished(self, finished_req_ids: set[str]) -> FinishedTransfers:
        self._progress()
        recving, self._finished_recving = self._finished_recving, set()
        return FinishedTransfers(self._leases.collect(self._clock()), recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def _progress(self) -> None:
        if self._endpoint is None:
            return
        for rec in self._endpoint.poll():
            job = self._recvs[rec.req_id]
            peer = self._peer(job.remote.address)
            if rec.is_ok:
                self.stats.record_done(rec.created_at, rec.finished_at, rec.nbytes, rec.num_descriptors)
                peer.done_ok.append(rec.req_id)
            else:
                self._fail(job, f"read from engine {job.remote.engine_id} at {job.remote.address}: {rec.error}")
                peer.done_failed.append(rec.req_id)
        now = self._clock()
        for address, peer in self._peers.items():
            self._collect_release(address, peer)
            self._send_release(address, peer)
            self._renew(address, peer, now)

    def _fail(self, job: RecvJob, error: str) -> None:
        logger.error("request %s: KV load failed: %s", job.request_id, error)
        self.stats.record_failure(error)
        self.stats.num_load_errors += len(job.local_block_ids)
        self._invalid_block_ids.update(job.local_block_ids)

    # ------------------------------------------------------------------ decode: releases and renewals

    def _send_release(self, address: str, peer: _PeerControl) -> None:
        if peer.in_flight is not None or not (peer.done_ok or peer.done_failed):
            return
        ok, failed = peer.done_ok, peer.done_failed
        peer.done_ok, peer.done_failed = [], []
        msg = m.TransferDone(
            engine_id=self.config.engine_id,
            req_ids=[self._recvs[r].remote_request_id for r in ok],
            failed_req_ids=[self._recvs[r].remote_request_id for r in failed],
        )
        future = peer.executor.submit(self._endpoint.request, address, msg)
        peer.in_flight = (future, ok)
        for req_id in failed:  # already reported as load errors; the release is a courtesy
            self._finish_recv(req_id)

    def _collect_release(self, address: str, peer: _PeerControl) -> None:
        if peer.in_flight is None or not peer.in_flight[0].done():
            return
        future, ok = peer.in_flight
        peer.in_flight = None
        try:
            reply = future.result()
            expired = set(reply.expired) if isinstance(reply, m.TransferDoneReply) else None
        except Exception as e:  # the prefill engine is gone or refuses: the reads cannot be vouched for
            logger.warning("TransferDone to %s failed: %s", address, e)
            expired = None
        for req_id in ok:
            job = self._recvs[req_id]
            if expired is None or job.remote_request_id in expired:
                self.stats.num_expired_reads += expired is not None
                self._fail(job, "the prefill engine's lease on the blocks was not confirmed after the read")
            self._finish_recv(req_id)

    def _finish_recv(self, req_id: str) -> None:
        job = self._recvs.pop(req_id)
        if job.local_block_ids:  # a release-only job never parked its request
            self._finished_recving.add(req_id)

    def _renew(self, address: str, peer: _PeerControl, now: float) -> None:
        if peer.renewing is not None:
            if not peer.renewing.done():
                return
            peer.renewing = None
        if now - peer.last_renew < self.options.renew_interval_s:
            return
        waiting = [j.remote_request_id for j in self._recvs.values() if j.remote.address == address]
        if waiting:
            msg = m.LeaseRenew(engine_id=self.config.engine_id, req_ids=waiting)
            peer.renewing = peer.executor.submit(self._endpoint.request, address, msg)
        peer.last_renew = now

    # ------------------------------------------------------------------ flush and shutdown

    def _pending_req_ids(self) -> set[str]:
        return set(self._recvs) | self._leases.pending()

    def flush(self, timeout_s: float) -> FlushResult:
        deadline = self._clock() + timeout_s
        failures_before = self.stats.num_failures
        while self._pending_req_ids() and self._clock() < deadline:
            self._progress()
            time.sleep(0.001)
        pending = frozenset(self._pending_req_ids())
        return FlushResult(not pending, pending, self.stats.num_failures - failures_before)

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        for peer in self._peers.values():
            peer.executor.shutdown(wait=False, cancel_futures=True)
        self._peers.clear()
        if self._endpoint is not None:
            self._endpoint.close()  # deregisters the KV tensor from NIXL and drops it
        self._endpoint = None
        self._recvs.clear()

    def get_step_stats(self) -> dict[str, Any]:
        """The side-channel port, so the scheduler half can put it in the kv_transfer_params it returns."""
        return {SIDE_CHANNEL_PORT_STAT: self.side_channel_port} if self.side_channel_port else {}

    def get_stats(self) -> dict[str, Any]:
        stats = self.stats.as_dict()
        stats["num_leases"] = len(self._leases)
        stats["num_expired_leases"] = self._leases.num_expired
        stats["num_recvs_in_flight"] = len(self._recvs)
        if self.side_channel_port:
            stats[SIDE_CHANNEL_PORT_STAT] = self.side_channel_port
        return stats
