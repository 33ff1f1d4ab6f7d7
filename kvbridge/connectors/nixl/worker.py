"""Worker half of the NixlConnector: moves the bytes, next to the KV cache tensor.

Decode (reader), per request:

    RecvJob --read_blocks--> HANDSHAKING --> POSTED --> DONE --TransferDone--> released: finished_recving
                                  |             |                  '--------> anything else: load error
                                  '-------------'--> FAILED | EXPIRED -------------------> load error

The handshake checks that the peer is the engine instance (engine id and incarnation) that
granted the lease; the release names the lease by its token, block ids and block hash, and only
an exact match is "released" (peer_control.py). A read is used only after that answer, and only
when the blocks read hold the bytes the prefill digested when it granted the lease: the answer
carries that digest, and the decode digests its own copy (transfer/digest.py). A mismatch, or an
answer without a digest, is a load error (NixlConnector option `verify_kv_digest`, on by default).

A load error reports the job's blocks in `get_block_ids_with_load_errors` together with the request
in `finished_recving`; the scheduler then recomputes them or fails the request (policy). Nothing
waits without a deadline: the endpoint's tracker expires handshakes and reads, and side-channel
requests have their own timeouts.

Prefill (owner), per request: the scheduler's plan grants a lease on the held blocks and the
worker digests their bytes; the side-channel thread renews or releases it (a release returns the
digest); `get_finished` reports released and expired leases in `finished_sending` so the
scheduler frees the blocks.

NIXL is touched only from the engine thread (`KVEndpoint` rule). Side-channel requests to a peer
(TransferDone, LeaseRenew) block, so they run on PeerControls' small shared thread pool.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge import env
from kvbridge.connectors.base import CompletedTransfers, ConnectorContext, FlushReport
from kvbridge.connectors.nixl import local_grants
from kvbridge.connectors.nixl.leases import LeaseTable
from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata, RecvJob, RemoteEngine
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.peer_control import PeerControls, Reading, Verdict
from kvbridge.connectors.nixl.scheduler import (
    DEVICE_READ_PEERS_STAT,
    SIDE_CHANNEL_PORT_STAT,
    UNREACHABLE_PEERS_STAT,
    unreachable_peer_key,
)
from kvbridge.connectors.nixl.stats import TransferStats
from kvbridge.connectors.nixl.verify import ReadVerifier
from kvbridge.errors import KVBridgeError
from kvbridge.repeated_log import RepeatedWarnings
from kvbridge.transfer import messages as m
from kvbridge.transfer.digest import DigestError, DigestJob
from kvbridge.transfer.grants import GrantError, check_grant, open_grant
from kvbridge.transfer.progress import drive_until

if TYPE_CHECKING:
    import torch

    from kvbridge.config import KVTransferConfig
    from kvbridge.layout import KVCacheLayout
    from kvbridge.transfer.endpoint import KVEndpoint
    from kvbridge.transfer.tracker import TransferRecord

logger = logging.getLogger(__name__)

MIN_RENEW_INTERVAL_S = 0.1  # renewals to one prefill engine are at least this far apart
IDLE_WAIT_POLL_S = 200e-6  # idle_step_wait_s: the longest sleep between two looks at the reads in flight


class NixlWorker:
    def __init__(self, config: KVTransferConfig, context: ConnectorContext, options: NixlOptions) -> None:
        self.config = config
        self.context = context
        self.options = options
        self.stats = TransferStats()
        self._clock = time.monotonic
        self._endpoint: KVEndpoint | None = None
        self._leases = LeaseTable(options.lease_s, context.incarnation)
        self._policy = options.peer_policy
        self._recvs: dict[str, RecvJob] = {}  # live and releasing reads, by local request id
        self._deadlines: dict[str, float] = {}  # local request id -> when its read must be confirmed
        self._admitted: dict[str, float] = {}  # local request id -> when its read began (lease renewals count from it)
        self._landed: dict[str, tuple[float, float]] = {}  # read, awaiting its verdict -> (posted, landed)
        self._newly_landed: set[str] = set()  # landed since the last get_landed_recving, still unconfirmed
        self._in_step: dict[str, TransferRecord] = {}  # this step's synchronous loads (sync_ipc_reads), until its verdicts
        self._reported_device_peers: list[str] | None = None  # DEVICE_READ_PEERS_STAT as last reported
        self._peers = PeerControls(
            self._send, config.engine_id, max_peers=options.max_peers, idle_s=options.peer_idle_s,
            renew_interval_s=options.renew_interval_s, clock=self._clock, wake=context.wakeup.ring,
            reader_rank=context.tp_rank, num_readers=context.tp_size,
        )  # fmt: skip
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._flip_landed_bit = env.fault_flip_read_bit() and env.fault_flip_read_bit_rank() in (None, context.tp_rank)
        self._confirm_delay_s = env.fault_delay_confirm_s()  # fault injection (tests): a slow confirmation
        self._unreachable: set[str] = set()  # prefill engines whose handshake failed, until get_step_stats reports them
        self._verifier: ReadVerifier | None = None  # decode: checks each read's bytes (verify_kv_digest)
        self._load_errors: dict[str, str] = {}  # request id -> why its load failed, until reported
        # Tensor parallelism, prefill: rank 0 grants a lease once every rank's digest of its own heads
        # is in (apply_tp_step_reports, the same step); ranks > 0 hold no lease, only digest at grant.
        self._ungranted: dict[str, tuple[m.LeaseRef, m.KVDigest | None]] = {}  # rank 0: own digest, awaiting the others'
        self._rank_digests: dict[str, m.KVDigest] = {}  # rank > 0: digested this step, for rank 0
        self._digested: set[str] = set()  # rank > 0: its part of these leases is done (finished_sending)
        self._wall_clock = time.time  # the clock of the grants' terms (the owner's, in the grant)
        self._grant_warnings = RepeatedWarnings(logger)  # forged grants must not write a line each
        self._is_shut_down = False
        self._idle_step = False  # this step's metadata said: the engine runs no model in it (idle_step_wait_s)

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        from kvbridge.transfer.endpoint import KVEndpoint  # imports nixl

        if self._endpoint is not None:
            raise RuntimeError("NixlConnector: register_kv_caches called twice")
        ctx = self.context
        self._endpoint = KVEndpoint(
            self.config.engine_id if ctx.tp_rank == 0 else f"{self.config.engine_id}.tp{ctx.tp_rank}",  # one NIXL agent per rank
            self.context.model_id,
            kv_cache,
            layout,
            incarnation=self.context.incarnation,
            host=self.config.side_channel_host,
            port=self.config.side_channel_port,
            serve=self.config.is_producer and ctx.tp_rank == 0,  # one side channel per node: rank 0's
            message_handler=self._on_message if self.config.is_producer else None,
            options=self.options,  # NixlOptions extends the endpoint's TransferOptions
            kv_head_start=ctx.kv_head_start,
            num_total_kv_heads=ctx.num_total_kv_heads,
        )
        self._verifier = ReadVerifier(self._endpoint, self.stats, self._clock) if self.options.verify_kv_digest else None
        if self._endpoint.server is not None and ctx.tp_size == 1 and self.options.verify_kv_digest and self.options.sign_grants:
            local_grants.register(ctx.incarnation, self)  # the scheduler half grants through us as requests finish
        if self._endpoint.server is not None:
            logger.info("NixlConnector %s: side channel on %s, serving KV to peers", self.config.engine_id, self._endpoint.address)

    @property
    def side_channel_port(self) -> int | None:
        server = self._endpoint.server if self._endpoint is not None else None
        return server.port if server is not None else None

    # ------------------------------------------------------------------ prefill: side-channel thread

    def _on_message(self, msg: m.Message) -> m.Message:
        match msg:
            case m.LeaseRenew(incarnation=incarnation, leases=leases):
                held, pending, unknown, _ = self._leases.renew(incarnation, leases, self._clock())
                return m.LeaseRenewReply(held=held, pending=pending, unknown=unknown)
            case m.TransferDone(incarnation=incarnation, leases=leases, failed_leases=failed):
                released, pending, unknown, digests = self._leases.release(
                    incarnation, leases, self._clock(), msg.reader_rank, msg.num_readers, abandoned=failed
                )
                return m.TransferDoneReply(released=released, pending=pending, unknown=unknown, digests=digests)
            case _:
                return m.ErrorReply(code=m.ErrorCode.UNSUPPORTED, message=f"{type(msg).__name__} is not handled here")

    def grant_now(self, lease: m.LeaseRef, lease_s: float) -> str | None:
        """Prefill, engine thread, as the request finishes (local_grants.py): digest the leased blocks,
        grant the lease and return its signed grant; None when the blocks cannot be digested (the
        lease is then granted in the next step, as without a granter)."""
        if self._endpoint is None:
            return None
        began = time.perf_counter()
        digest = self._digest(lease)  # on the endpoint's digest stream: no wait for a forward in flight
        if digest is None:
            return None
        self._leases.grant(lease, self._clock(), digest)
        grant = self._endpoint.grants.sign(lease, self.context.incarnation, digest, lease_s)
        self.stats.record_grant(time.perf_counter() - began)
        return grant

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, metadata: NixlConnectorMetadata | None) -> None:
        self._idle_step = metadata is not None and metadata.idle_step
        if metadata is None:
            return
        now = self._clock()
        for lease in metadata.leases.values():
            digest = self._digest(lease)
            if self.context.tp_size == 1:
                self._leases.grant(lease, now, digest)
            elif self.context.tp_rank == 0:
                self._ungranted[lease.req_id] = (lease, digest)
            else:
                if digest is not None:
                    self._rank_digests[lease.req_id] = digest
                self._digested.add(lease.req_id)
        for job in metadata.recvs.values():
            if job.sync:
                self._start_in_step(job, now)
            else:
                self._start_recv(job, now)

    def _digest(self, lease: m.LeaseRef) -> m.KVDigest | None:
        """The digest of the leased blocks' bytes now, on their device (None: verification is off)."""
        if not self.options.verify_kv_digest or self._endpoint is None:
            return None
        try:
            return self._endpoint.digest_lease(lease.block_ids, per_head=self.options.digest_kv_heads)
        except (DigestError, IndexError) as e:  # readers that verify will refuse this lease's blocks
            logger.error("request %s: cannot digest its leased blocks: %s", lease.req_id, e)
            return None
        except Exception:  # a defect, not this request's fault: it costs this lease's reads, never the engine
            logger.exception("request %s: digesting its leased blocks failed; readers that verify will refuse them",
                             lease.req_id)  # fmt: skip
            return None

    def _track(self, job: RecvJob, now: float) -> bool:
        """Record a read starting now. False when its prefill host is not allowed: refused, a load error
        (the scheduler half refuses such params first)."""
        self._recvs[job.request_id] = job
        self._deadlines[job.request_id] = now + self.options.transfer_timeout_s
        self._admitted[job.request_id] = now
        if not self._policy.allows(job.remote.host):
            self._refuse(job, f"prefill host {job.remote.host!r} is not in the NixlConnector option allowed_peers")
            return False
        return True

    def _start_recv(self, job: RecvJob, now: float) -> None:
        if not self._track(job, now):
            return
        remote = job.remote
        if not self._peers.admits(remote, busy={j.remote for j in self._recvs.values() if j is not job}):
            return self._refuse(
                job, f"this node is reading from {self.options.max_peers} prefill addresses already (NixlConnector option max_peers)"
            )
        if not job.local_block_ids:  # everything hit locally: only release the prefill's blocks
            self._peers.abandon(remote, job.lease)
            return self._finish_recv(job.request_id)
        try:
            self._endpoint.read_blocks(
                job.request_id, remote.address, job.local_block_ids, job.remote_block_ids,
                expect=(remote.engine_id, remote.incarnation),
            )  # fmt: skip
        except (KVBridgeError, ValueError, IndexError, OverflowError) as e:  # this request's fault only
            self._refuse(job, f"{type(e).__name__}: {e}")

    def _start_in_step(self, job: RecvJob, now: float) -> None:
        """A synchronous load (NixlConnector option sync_ipc_reads; the scheduler half chose it for a
        granted read from a peer this worker said it reads on its device): the CUDA IPC copy and its
        digest are queued now, and this step's forward pass waits for both on the device. Its verdict
        comes in this step's `get_finished`, before vLLM takes the step's output: a mismatch is a load
        error, and vLLM drops the token computed on those blocks and recomputes them. A read that cannot
        go that way any more (the peer forgotten or restarted, the grant expired) is a load error too,
        reported in this step: nothing is left in flight, so no byte lands after the step began."""
        if not self._track(job, now):
            return
        remote = job.remote
        if self._usable_grant(job) is None:
            return self._refuse_in_step(job, "its prefill's signed grant cannot be relied on, and a synchronous load is "
                                        "verified by its grant in its own step")  # fmt: skip
        try:
            rec = self._endpoint.read_blocks_in_step(
                job.request_id, remote.address, job.local_block_ids, job.remote_block_ids,
                expect=(remote.engine_id, remote.incarnation),
            )  # fmt: skip
        except (KVBridgeError, ValueError, IndexError, OverflowError) as e:
            return self._refuse_in_step(job, f"{type(e).__name__}: {e}")
        if rec is None:
            return self._refuse_in_step(job, f"engine {remote.engine_id} at {remote.address} cannot be read by CUDA IPC "
                                        "in this step any more (forgotten, restarted, or too few runs of blocks)")  # fmt: skip
        if self._flip_landed_bit:  # fault injection (tests): a bit flipped in flight, before the digest sees it
            self._endpoint.hold_stream_for_digests()  # after the copy
            self._endpoint.flip_bit(job.local_block_ids[0])
        # on the digest stream, after the copy (a copy on the SMs took them as it wrote the blocks)
        self._verifier.start(job, None if self._flip_landed_bit else rec.copy_digests)
        self._endpoint.hold_stream_for_digests()  # the forward pass may rewrite the prompt's last slot
        self._in_step[job.request_id] = rec

    def _refuse_in_step(self, job: RecvJob, error: str) -> None:
        """A synchronous load that cannot be made: a load error now, and the prefill's blocks released."""
        self.stats.num_refused_sync_reads += 1
        if job.remote.address in self._endpoint.peers:
            self._peers.abandon(job.remote, job.lease)
        self._refuse(job, f"synchronous load: {error}")

    def _refuse(self, job: RecvJob, error: str) -> None:
        """Fail a read that never started: a load error for its blocks, nothing sent anywhere."""
        self._fail(job, error)
        self._finish_recv(job.request_id)

    def wait_for_save(self, metadata: NixlConnectorMetadata | None) -> None:
        pass  # prefill never writes: the decode side reads the blocks while they are leased

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        for rec in self._in_step.values():  # this step's synchronous loads: their verdicts come now
            self._endpoint.wait_in_step_read(rec)
        self._progress()
        if self._idle_step and self._recvs and not self._finished_recving:
            self._wait_in_idle_step()
        self._idle_step = False  # said of this step only: a get_finished without a start_load_kv never waits
        self._in_step.clear()
        recving, self._finished_recving = self._finished_recving, set()
        sending, self._digested = self._leases.collect(self._clock()) | self._digested, set()
        return CompletedTransfers(sending, recving)

    def _wait_in_idle_step(self) -> None:
        """A step in which the engine runs no model and polls again only after it (vLLM sleeps ~1 ms,
        then runs another empty step): wait up to idle_step_wait_s for a read in flight to end, so that
        its request computes in the next step rather than some polls later. Only its end counts (such an
        engine, vLLM, never computes on a read that landed unconfirmed). No model runs meanwhile; only
        a request arriving now waits, at most that long."""
        wait_s = self.options.idle_step_wait_s
        if wait_s <= 0:
            return
        began = self._clock()
        # a side-channel answer rings the context's Wakeup (PeerControls): the wait ends on it at once;
        # a landing (NIXL, a CUDA event) is polled, at most IDLE_WAIT_POLL_S apart
        if drive_until(lambda: bool(self._finished_recving) or not self._recvs, began + wait_s,
                       progress=self._progress, first_wait_s=IDLE_WAIT_POLL_S / 8, max_wait_s=IDLE_WAIT_POLL_S,
                       clock=self._clock, sleep=self.context.wakeup.wait):  # fmt: skip
            self.stats.num_idle_step_waits_ended += 1
        else:
            self.stats.num_idle_step_waits_timed_out += 1
        self.stats.idle_step_wait_s += self._clock() - began

    # ------------------------------------------------------------------ tensor parallelism (connectors/base.py)

    def tp_rank_info(self) -> bytes:
        """This rank's NIXL agent, region and KV heads, for rank 0's handshake answers."""
        return msgspec.msgpack.encode(self._endpoint.rank_shard(self.context.tp_rank))

    def set_tp_rank_infos(self, infos: list[bytes]) -> None:
        self._endpoint.set_node_ranks([msgspec.msgpack.decode(info, type=m.RankShard) for info in infos])

    def tp_step_report(self) -> bytes:
        report, self._rank_digests = m.RankDigests(digests=self._rank_digests), {}
        return msgspec.msgpack.encode(report)

    def apply_tp_step_reports(self, reports: list[bytes]) -> None:
        """Rank 0: grant this step's leases with every rank's digest. A rank that could not digest
        leaves the lease without one: readers that verify refuse it (they never use unproven KV)."""
        others = [msgspec.msgpack.decode(r, type=m.RankDigests).digests for r in reports]
        now = self._clock()
        for req_id, (lease, digest) in self._ungranted.items():
            rank_digests = [d.get(req_id) for d in others]
            if digest is not None and all(r is not None and r.alg == digest.alg for r in rank_digests):
                digest = m.KVDigest(alg=digest.alg, values=digest.values, head_values=digest.head_values, ranks=rank_digests)
            else:
                digest = None
            self._leases.grant(lease, now, digest)
        self._ungranted.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def get_load_errors(self) -> dict[str, str]:
        errors, self._load_errors = self._load_errors, {}
        return errors

    def _progress(self) -> None:
        if self._endpoint is None:
            return
        landed: list[RecvJob] = []
        copied: dict[str, DigestJob] = {}  # req id -> the digests its read took of the blocks it wrote (on the SMs)
        for rec in self._endpoint.poll():
            job = self._recvs[rec.req_id]
            if rec.is_ok:
                self.stats.record_done(rec.created_at, rec.finished_at, rec.nbytes, rec.num_descriptors, rec.device_s)
                if self._flip_landed_bit and not job.sync:  # fault injection (tests): a bit flipped in flight
                    self._endpoint.flip_bit(job.local_block_ids[0])
                elif rec.copy_digests is not None:
                    copied[rec.req_id] = rec.copy_digests
                self._landed[rec.req_id] = (rec.created_at, rec.finished_at)
                if self._verify_by_grant(job, copied.get(rec.req_id)):
                    continue
                if job.sync:  # its grant's term ended within the step: no verdict now means none in time
                    self._fail(job, "synchronous load: its prefill's signed grant could not be relied on when it landed")
                    self._peers.abandon(job.remote, job.lease)
                    self._finish_recv(rec.req_id)
                    continue
                self._peers.confirm(job.remote, rec.req_id, job.lease, self._deadlines[rec.req_id])
                landed.append(job)
            else:
                self._fail(job, f"read from engine {job.remote.engine_id} at {job.remote.address}: {rec.error}")
                if job.remote.address in self._endpoint.peers:  # it answered: let it free the blocks now
                    self._peers.abandon(job.remote, job.lease)
                elif "PeerUnreachableError" in (rec.error or ""):  # no answer: the scheduler half stops trying it
                    self._unreachable.add(unreachable_peer_key(job.remote.address, job.remote.incarnation))
                self._finish_recv(rec.req_id)
        outcomes = self._peers.progress(self._reading())  # sends the confirmations queued above
        for job in landed:
            if self._verifier is not None:  # digested while those confirmations are on the network
                self._verifier.start(job, copied.get(job.request_id))
            if self._may_compute_early(job):
                self._newly_landed.add(job.request_id)
        for outcome in outcomes:
            job = self._recvs[outcome.req_id]
            if outcome.verdict is Verdict.REFUSED:
                self.stats.num_expired_reads += 1
                self._fail(job, outcome.reason)
            elif self._verifier is not None and (error := self._verifier.verify(job, outcome.digest)) is not None:
                self._fail(job, error)
            elif (landed := self._landed.get(outcome.req_id)) is not None:
                self.stats.record_confirmed(*landed, self._clock())
            self._finish_recv(outcome.req_id)
        busy = {job.remote for job in self._recvs.values()}
        dropped = self._peers.drop_idle(busy)
        in_use = {r.address for r in busy} | self._peers.addresses()
        for address in {r.address for r in dropped} - in_use:
            self._endpoint.forget_peer(address)  # its NIXL agent, cached lists, mapping and socket

    def _verify_by_grant(self, job: RecvJob, copied: DigestJob | None = None) -> bool:
        """A landed read whose params carry the prefill's signed grant: verify its bytes against the
        grant's digests now and finish it (a load error on a mismatch), releasing the lease without
        waiting for an answer. False: no usable grant; the read is confirmed on the side channel.
        `copied`: the digests its copy took of the blocks it wrote (a read on the SMs)."""
        grant = self._usable_grant(job)
        if grant is None:
            return False
        if copied is not None:
            self._verifier.start(job, copied)
        if (error := self._verifier.verify(job, grant.digest)) is not None:  # digests what landed, now
            self._fail(job, error)
        else:
            self.stats.num_granted_reads += 1
            self.stats.num_sync_reads += job.sync
            posted, landed = self._landed[job.request_id]
            self.stats.record_confirmed(posted, landed, self._clock())
        self._peers.release(job.remote, job.lease)
        self._finish_recv(job.request_id)
        return True

    def _usable_grant(self, job: RecvJob) -> m.LeaseGrant | None:
        """The grant in `job`'s params when this node may rely on it: verification on, one rank on
        both sides, signed with the key the prefill gave us in its handshake, naming exactly this
        lease and prefill instance, with time left on its term."""
        if not job.grant or self._verifier is None or self.context.tp_size != 1:
            return None
        peers = self._endpoint.peers
        if job.remote.address not in peers or peers.get(job.remote.address).ranks:
            return None
        try:
            grant = open_grant(peers.get(job.remote.address).grant_key, job.grant)
            check_grant(grant, job.lease, job.remote.incarnation, self._wall_clock())
        except GrantError as e:
            self.stats.num_unusable_grants += 1
            self._grant_warnings.warning(str(e), "request %s: confirming the read with the prefill instead of by its grant: %s",
                                         job.request_id, e)  # fmt: skip
            return None
        return grant

    def _may_compute_early(self, job: RecvJob) -> bool:
        """Whether the scheduler may compute on this landed read before its verdict (get_landed_recving).

        Only with one rank (under TP the node's read lands when every rank's has, which no rank
        knows) and only once its digest was taken: the early step may rewrite the prompt's last
        slot, and the check must see the bytes as they landed.
        """
        if self.context.tp_size != 1 or not job.local_block_ids:
            return False
        return self._verifier is None or self._verifier.has_started(job.request_id)

    def get_landed_recving(self) -> set[str]:
        landed, self._newly_landed = self._newly_landed, set()
        return landed

    def _reading(self) -> dict[RemoteEngine, list[Reading]]:
        """Leases of reads still in flight, handshakes included, by prefill engine: renewed while
        the read lasts, every min(this node's lease_s, the prefill's) / 3 from admission.

        Renewals to an engine that has not answered a handshake yet go on the best-effort pool:
        side-channel requests to an address that never answers must not hold a confirmation's thread.
        """
        reading: dict[RemoteEngine, list[Reading]] = {}
        peers = self._endpoint.peers
        for req_id, job in self._recvs.items():
            if not job.local_block_ids or self._endpoint.tracker.get(req_id) is None:
                continue
            answered = job.remote.address in peers
            if not answered and not peers.is_handshaking(job.remote.address):
                continue
            # params name the prefill's term; a forged tiny one must not turn renewals into a flood
            interval_s = max(MIN_RENEW_INTERVAL_S, job.lease_s / 3) if job.lease_s > 0 else float("inf")
            reading.setdefault(job.remote, []).append(Reading(job.lease, self._admitted[req_id], interval_s, answered))
        return reading

    def _send(self, remote: RemoteEngine, msg: m.Message) -> m.Message:
        """Side-channel request to a prefill engine; runs on PeerControls' pool."""
        if self._confirm_delay_s and isinstance(msg, m.TransferDone) and msg.leases:
            time.sleep(self._confirm_delay_s)
        return self._endpoint.request(remote.address, msg, audience=(remote.engine_id, remote.incarnation))

    def _fail(self, job: RecvJob, error: str) -> None:
        logger.error("request %s: KV load failed: %s", job.request_id, error)
        self.stats.record_failure(error)
        self.stats.num_load_errors += len(job.local_block_ids)
        self._invalid_block_ids.update(job.local_block_ids)
        self._load_errors[job.request_id] = error

    def _finish_recv(self, req_id: str) -> None:
        job = self._recvs.pop(req_id)
        self._deadlines.pop(req_id, None)
        self._admitted.pop(req_id, None)
        self._landed.pop(req_id, None)
        self._newly_landed.discard(req_id)  # its verdict is in: reported as finished, not as landed
        if self._verifier is not None:
            self._verifier.forget(req_id)
        if job.local_block_ids:  # a release-only job never parked its request
            self._finished_recving.add(req_id)

    # ------------------------------------------------------------------ flush and shutdown

    def _pending_req_ids(self) -> set[str]:
        return set(self._recvs) | self._leases.pending(self._clock())

    def flush(self, timeout_s: float) -> FlushReport:
        failures_before = self.stats.num_failures
        drive_until(lambda: not self._pending_req_ids(), self._clock() + timeout_s, progress=self._progress,
                    clock=self._clock, sleep=self.context.wakeup.wait)  # fmt: skip
        pending = frozenset(self._pending_req_ids())
        return FlushReport(not pending, pending, self.stats.num_failures - failures_before)

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        local_grants.unregister(self.context.incarnation)
        self._peers.close()
        if self._endpoint is not None:
            self._endpoint.close()  # deregisters the KV tensor from NIXL and drops it
        self._endpoint = self._verifier = None
        self._recvs.clear()

    def get_step_stats(self) -> dict[str, Any]:
        """The side-channel port, so the scheduler half can put it in the kv_transfer_params it returns."""
        stats: dict[str, Any] = {SIDE_CHANNEL_PORT_STAT: self.side_channel_port} if self.side_channel_port else {}
        if self._unreachable:
            stats[UNREACHABLE_PEERS_STAT], self._unreachable = sorted(self._unreachable), set()
        device_peers = self._device_read_peers()
        if device_peers != self._reported_device_peers:
            stats[DEVICE_READ_PEERS_STAT] = self._reported_device_peers = device_peers
        return stats

    def _device_read_peers(self) -> list[str] | None:
        """With sync_ipc_reads, one rank and verified reads: the prefill engines this worker can read from
        in a step (CUDA IPC, same pages, a grant key), as unreachable_peer_key strings. None: the option is off."""
        if not self.options.sync_ipc_reads or self._endpoint is None:
            return None
        if self.context.tp_size != 1 or self._verifier is None:
            return []
        return sorted(unreachable_peer_key(address, peer.incarnation)
                      for address, peer in self._endpoint.in_step_peers() if peer.grant_key and not peer.ranks)  # fmt: skip

    def get_stats(self) -> dict[str, Any]:
        stats = self.stats.as_dict()
        stats["num_leases"] = len(self._leases)
        stats["num_expired_leases"] = self._leases.num_expired
        stats["num_leases_abandoned_before_grant"] = self._leases.num_abandoned_before_grant
        stats["num_recvs_in_flight"] = len(self._recvs)
        if self._endpoint is not None:  # reads that expired in flight, blocks held until NIXL ends them
            stats["num_quarantined_reads"] = self._endpoint.num_quarantined
            stats["num_quarantined_reads_total"] = self._endpoint.num_quarantined_reads
            stats["num_quarantine_timeouts"] = self._endpoint.num_quarantine_timeouts
            # of those, reads from a prefill no read had completed from: it may not have answered the connection
            stats["num_quarantined_first_reads"] = self._endpoint.num_quarantined_first_reads
            ep_stats = self._endpoint.get_stats()  # reads from peers whose pages differ, by plan kind (layout_plan.py)
            for key in ("num_direct_plan_reads", "num_staged_plan_reads", "num_plan_descriptors",
                        "num_process_stalls", "max_process_stall_s"):  # fmt: skip
                stats[key] = ep_stats[key]
        stats["num_refused_lease_requests"] = self._leases.num_refused
        stats["num_peers"] = len(self._peers)
        if self.side_channel_port:
            stats[SIDE_CHANNEL_PORT_STAT] = self.side_channel_port
        return stats
