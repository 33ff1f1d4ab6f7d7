"""`KVEndpoint`: one engine's KV tensor on the wire. What the NIXL connector builds on.

An endpoint owns one `NixlAgent` with the engine's KV tensor registered, a `SideChannelServer`
answering handshakes (and passing other messages to the connector's `message_handler`), side
channel clients to peers, and a `TransferTracker`. The decode side pulls:

    ep = KVEndpoint(engine_id, model_id, kv, layout, host=..., port=..., message_handler=on_msg)
    rec = ep.read_blocks(req_id, remote_address, local_ids, remote_ids, expect=(peer_engine_id, peer_incarnation))
    ...each engine step: for rec in ep.poll(): report rec.req_id as done / failed
    ep.request(remote_address, m.TransferDone(...), audience=...)  # tell the owner its blocks were read
    ep.close()  # at shutdown

The owner of the blocks (the prefill side) only serves: its `message_handler` receives the
side-channel messages of its readers (`TransferDone`, `LeaseRenew`, ...) on the server thread.

A NIXL read that expires while NIXL still reports it in progress may go on writing into its
destination blocks: neither releasing its handle nor removing the peer's agent stops bytes already
on their way (measured over UCX's TCP transport: they land after both). Such a read is quarantined:
its handle is kept and polled, and its record is reported only once NIXL says the transfer is over,
so the owner of the blocks never frees or reuses them while a late write could land. No timeout
ends a quarantine (`_end_quarantines` says what does): a quarantine past `transfer_timeout_s` is
logged as an error and counted (`num_quarantine_timeouts`), and its blocks stay withheld, because
NIXL offers no way to fence the transfer's writes before it ends. (The peer is not disconnected
either: removing an agent with a transfer in flight over a partitioned link blocked for tens of
seconds and left later reads from that peer failing, measured in tests/serve/test_netns.py, and it
does not stop the bytes.)

The first NIXL read from a peer also opens UCX's connection to it, and NIXL reports that read done
only once the peer's UCX worker has answered the connection: its bytes may all have landed while it
still waits (measured between two processes of one host over UCX's default transports). A peer answers from
NIXL's progress thread, whatever its engine thread is doing (a prefill waiting in a prefix-cache
reset, say), so a first read that expires in flight names the peer's NIXL progress as the suspect
(logged, and counted in `num_quarantined_first_reads`).

`read_blocks` never blocks: when the peer is not known yet the record starts HANDSHAKING and the handshake runs on a helper thread (network only); NIXL is only touched from
the owner's thread, in `poll`. A transfer failure forgets the peer so the next transfer
handshakes again (a restarted peer is picked up). Every live record has a deadline.

Each endpoint has a random `incarnation`, sent in its handshake answer. A transfer started with
`expect=(engine_id, incarnation)` is posted only to that very instance: when the cached peer at
the address is another one, the peer is handshaked again, and the transfer fails if the address
still answers with another instance (it restarted since the caller learnt of it, or the caller was
given stale or forged params).

The KV cache may also be a `LayerTensors` (an engine that allocates each layer alone): every layer's
pages are then registered as a region of their own in one NIXL registration, the handshake answer
carries each layer's address (`KVRegion.layer_addrs`), and descriptors map the layout's offsets
into them (one per run of blocks per layer). Such an endpoint reads through NIXL only (no CUDA IPC
mapping of one allocation) and refuses translated reads, naming both layouts.

A transfer goes through NIXL in a `DescriptorMode` (options.py, nixl_post.py), or, with a
same-host GPU peer and at least `ipc_min_runs` runs of blocks, through a CUDA IPC mapping of the
peer's KV tensor (cuda_ipc.py). docs/transfer.md has the measurements.

A peer of the same model whose block size or page format differs from ours (the handshake's
model hash) is read through a plan (layout_plan.py): DIRECT into our pages, or STAGED into a
staging buffer and gathered into our pages when NIXL reports the read done. The remote and local
id lists may then differ in length (the prompt's tokens fill ceil(T / P) of its blocks and
ceil(T / D) of ours). The kind is logged once per peer and counted in `get_stats`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from kvbridge import env
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.layer_tensors import LayerTensors
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.agent import NixlAgent, XferState
from kvbridge.transfer.auth import audience_of, check_exposure, check_secret
from kvbridge.transfer.cuda_ipc import IpcCopier, IpcCopy
from kvbridge.transfer.cuda_ipc import export_tensor as cuda_ipc_export
from kvbridge.transfer.delayed_post import DelayedPost
from kvbridge.transfer.digest import (
    DigestError,
    DigestJob,
    algorithm_for,
    block_digests,
    region_bytes,
    start_block_digests,
)
from kvbridge.transfer.grants import GrantSigner
from kvbridge.transfer.head_digests import head_block_digests, lease_digests
from kvbridge.transfer.handshake import LocalIdentity, PeerInfo, answer_handshake, describe_layout
from kvbridge.transfer.host_secret import side_channel_secret
from kvbridge.transfer.interfaces import ucx_on_interface_of
from kvbridge.transfer.layout_gather import rebuild_blocks
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.layout_plan import PlanKind, plan_read
from kvbridge.transfer.nixl_post import NixlPost, NixlPoster, poll_post
from kvbridge.transfer.options import DescriptorMode, TransferOp, TransferOptions
from kvbridge.transfer.peers import PeerDirectory
from kvbridge.transfer.side_channel import SideChannelServer
from kvbridge.transfer.stall_watch import StallWatch
from kvbridge.transfer.tracker import TransferRecord, TransferState, TransferTracker

if TYPE_CHECKING:
    import torch

_FROM_ENV = object()
logger = logging.getLogger(__name__)


class _Read(NamedTuple):
    local_ids: np.ndarray  # [n] int64
    remote_ids: np.ndarray  # [n] int64
    expect: tuple[str, str] | None  # (engine_id, incarnation) the peer must be; None: whoever answers


def check_kv_view(kv_cache: torch.Tensor | LayerTensors, layout: KVCacheLayout) -> None:
    """ConfigError unless `kv_cache` is the (num_blocks, num_layers, *page_shape) view `layout` describes,
    or the `LayerTensors` of that layout (checked when it was built)."""
    if isinstance(kv_cache, LayerTensors):
        if kv_cache.layout != layout:
            raise ConfigError(f"the layer tensors were built for layout {kv_cache.layout}, not {layout}")
        return
    shape, strides = tuple(kv_cache.shape), tuple(kv_cache.stride())
    # a dimension of size 1 is never stepped over: its stride does not matter
    placed = all(n == 1 or s == want for n, s, want in zip(layout.shape, strides, layout.strides))
    if shape != layout.shape or kv_cache.element_size() != layout.element_size or not placed:
        raise ConfigError(
            f"KV tensor of shape {shape}, strides {strides} and {kv_cache.element_size()}-byte elements is not the "
            f"view of layout {layout}: shape {layout.shape}, strides {layout.strides}, {layout.element_size}-byte "
            "elements; build it with torch.as_strided(buffer, layout.shape, layout.strides)"
        )


class KVEndpoint:
    """One engine's registered KV tensor, its side channel, and its transfers.

    Call every method from the owner's thread, except `request` (any thread). `message_handler` runs
    on the side-channel server thread.
    """

    def __init__(
        self,
        engine_id: str,
        model_id: str,
        kv_cache: torch.Tensor | LayerTensors,  # [num_blocks, num_layers, *page_shape], strided as `layout` says
        layout: KVCacheLayout,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        serve: bool = True,
        secret: bytes | None = _FROM_ENV,  # default: host_secret.side_channel_secret(); None: unauthenticated
        message_handler: Callable[[m.Message], m.Message | None] | None = None,
        options: TransferOptions | None = None,  # backend, timeouts, descriptor mode, CUDA IPC; default: defaults
        clock: Callable[[], float] = time.monotonic,
        incarnation: str | None = None,  # default: a fresh random one
        kv_head_start: int = 0,  # tensor parallelism: the first of the model's KV heads our pages hold
        num_total_kv_heads: int | None = None,  # the model's KV heads (None: layout.num_kv_heads, TP 1)
    ) -> None:
        check_kv_view(kv_cache, layout)
        opts = options or TransferOptions()  # validated when built: before anything is registered
        self.engine_id = engine_id
        self.incarnation = incarnation or secrets.token_hex(16)
        self.layout = layout
        self.shard = KVShard(layout, kv_head_start, num_total_kv_heads)
        self.compat_hash = layout.compat_hash(model_id)
        self.transfer_timeout_s = opts.transfer_timeout_s
        self._wait_ipc_reads = opts.wait_ipc_reads
        self._read_delay_s = env.fault_delay_read_s()  # fault injection (tests): reads whose bytes land late
        self._digest_defect = env.fault_digest_defect()  # fault injection (tests): lease digests that raise
        if secret is _FROM_ENV:
            self._secret = side_channel_secret(opts.insecure_side_channel)
        else:
            check_secret(secret)
            self._secret = secret
        if serve:  # before anything is registered
            check_exposure(host, self._secret, opts.insecure_side_channel)
        self._message_handler = message_handler
        self._kv = kv_cache
        self._region_bytes = region_bytes(kv_cache, layout)  # [region_nbytes] uint8, for digests
        self.digest_alg = algorithm_for(kv_cache)
        self.grants = GrantSigner()  # random per endpoint: its key reaches readers in handshake answers only
        self._digest_stream = None
        if kv_cache.is_cuda:
            import torch

            self._digest_stream = torch.cuda.Stream(kv_cache.device)
        with ucx_on_interface_of(host):  # transfers stay on the interface peers reach us at
            self.agent = NixlAgent(engine_id, opts.backend, backend_params=opts.backend_params)
        self._region = self._register(kv_cache, layout)
        self._nixl = NixlPoster(
            self.agent, layout, self._region, opts.descriptor_mode, opts.max_descriptor_nbytes, device=kv_cache.device
        )
        # CUDA IPC maps one allocation: KV held one tensor per layer goes through NIXL
        self._is_per_layer = isinstance(kv_cache, LayerTensors)
        use_ipc = opts.cuda_ipc and kv_cache.is_cuda and not self._is_per_layer
        self._me = LocalIdentity(
            engine_id, self.incarnation, self.compat_hash, engine_id, self.agent.metadata, self._region, layout,
            cuda_ipc=cuda_ipc_export(self._region_bytes) if use_ipc else None, digest_alg=self.digest_alg,
            model_hash=layout.model_hash(model_id, self.shard.total_kv_heads),
            kv_head_start=kv_head_start, num_total_kv_heads=num_total_kv_heads or 0,
            grant_key=self.grants.key if serve else b"",
        )
        self.num_plans = {kind: 0 for kind in PlanKind}  # translated reads posted, by plan kind
        self.num_plan_descriptors = 0  # descriptors those reads posted
        self._logged_plans: set[tuple[str, PlanKind]] = set()  # (peer, kind) already logged
        self.tracker = TransferTracker(clock)
        self.peers = PeerDirectory(
            self.agent, self._me, secret=self._secret, timeout_s=opts.handshake_timeout_s,
            retries=opts.handshake_retries, cache_block_lists=opts.descriptor_mode is DescriptorMode.BLOCKS,
            ipc_device=kv_cache.device if use_ipc else None,
            before_unmap=self._sync_ipc_copies,  # nothing may use a mapping once it is closed
        )
        # through CUDA IPC mappings
        self._ipc = IpcCopier(kv_cache, layout, opts.ipc_min_runs, opts.ipc_sm_reads) if use_ipc else None
        # req id -> (expired read in flight, since, the peer instance it reads from)
        self._quarantine: dict[str, tuple[TransferRecord, float, tuple[str, str]]] = {}
        self._unquarantined: list[TransferRecord] = []  # ended quarantines, reported by the next poll
        self._overdue: set[str] = set()  # quarantines past transfer_timeout_s, already logged and counted
        self.num_quarantined_reads = self.num_quarantine_timeouts = 0
        self.num_quarantined_first_reads = 0  # of those, reads from a peer no read had completed from
        self._to_forget: set[str] = set()  # peers to forget once no NIXL read from them is in flight
        self._connected: set[str] = set()  # peers a NIXL read has completed from: their connection answered
        self._closed = False
        self.server = (
            SideChannelServer(host, port, self._serve, self._secret, audience=audience_of(engine_id, self.incarnation))
            if serve else None
        )  # fmt: skip
        # Says in the log when this process was not scheduled for a while (a peer then sees silence).
        self.stall_watch = StallWatch(f"KV endpoint of engine {engine_id}").start()

    def _register(self, kv_cache: torch.Tensor | LayerTensors, layout: KVCacheLayout) -> m.KVRegion:
        """Register the KV pages with NIXL: one region spanning them all, or one per layer (registered at
        once) for KV held one tensor per layer."""
        if isinstance(kv_cache, LayerTensors):
            regs = self.agent.register_tensors([kv_cache.layer_span(i) for i in range(layout.num_layers)])
            first = regs[0]
            return m.KVRegion(
                base_addr=first.base_addr, nbytes=first.nbytes, device_id=first.device_id, mem_type=first.mem_type,
                layer_addrs=tuple(r.base_addr for r in regs), layer_stride=layout.layer_stride_bytes,
            )  # fmt: skip
        # [region_nbytes / element size]: every byte from page (0, 0) to the end of the last page,
        # as one contiguous tensor (as_strided refuses a view that outruns the storage)
        region = kv_cache.as_strided((layout.region_nbytes // layout.element_size,), (1,))
        reg = self.agent.register_tensor(region)
        return m.KVRegion(base_addr=reg.base_addr, nbytes=reg.nbytes, device_id=reg.device_id, mem_type=reg.mem_type)

    def rank_shard(self, rank: int) -> m.RankShard:
        """This endpoint as rank `rank` of a tensor-parallel node, for its rank 0's handshake answers."""
        return m.RankShard(
            rank=rank, agent_name=self._me.agent_name, agent_metadata=self._me.agent_metadata, region=self._region,
            kv_head_start=self.shard.head_start, num_kv_heads=self.layout.num_kv_heads,
        )  # fmt: skip

    def set_node_ranks(self, ranks: list[m.RankShard]) -> None:
        """Rank 0 of a tensor-parallel node: answer handshakes with the node's other ranks too (their
        agents, regions and KV heads), so that readers read every rank's heads under this node's leases."""
        self._me = dataclasses.replace(self._me, ranks=tuple(ranks))

    @property
    def address(self) -> str | None:
        """This endpoint's side-channel address (what peers handshake with), or None when not serving."""
        return self.server.address if self.server else None

    # ------------------------------------------------------------------ server side (server thread)

    def _serve(self, msg: m.Message) -> m.Message | None:
        match msg:
            case m.HandshakeRequest():
                return answer_handshake(msg, self._me)
            case m.Ping():
                return m.Pong(engine_id=self.engine_id, incarnation=self.incarnation)
            case _ if self._message_handler is not None:
                return self._message_handler(msg)
            case _:
                return m.ErrorReply(code=m.ErrorCode.UNSUPPORTED, message=f"{type(msg).__name__} is not handled here")

    # ------------------------------------------------------------------ peers

    def handshake(self, address: str) -> PeerInfo:
        """Blocking handshake with the endpoint at `address` (cached). Raises the named errors."""
        return self.peers.handshake(address)

    def forget_peer(self, address: str) -> None:
        """Drop a peer's metadata and cached lists; the next transfer to it handshakes again.

        Deferred while NIXL reads from it are in flight or quarantined: once its agent is removed,
        NIXL reports those reads over while their bytes may still land.
        """
        if self._reads_from(address):
            self._to_forget.add(address)
            return
        self._to_forget.discard(address)
        self._connected.discard(address)
        self.peers.forget(address)

    def _reads_from(self, address: str) -> bool:
        """Whether NIXL reads from `address` are in flight (posted or quarantined)."""
        live = any(r.peer == address and isinstance(r.handle, NixlPost) for r in self.tracker.live())
        return live or any(entry[0].peer == address for entry in self._quarantine.values())

    def request(self, address: str, msg: m.Message, audience: tuple[str, str] | None = None) -> m.Message:
        """Send a side-channel message (LeaseRenew, TransferDone, Ping...) to `address` and return the reply.

        Blocking (up to handshake_timeout_s x (handshake_retries + 1)); safe from any thread, e.g. a
        helper thread so the engine step never waits. Raises the named errors of SideChannelClient.
        `audience` is the (engine_id, incarnation) the message is for; signed requests that change
        state must name it.
        """
        return self.peers.request(address, msg, audience_of(*audience) if audience else b"")

    # ------------------------------------------------------------------ transfers

    def read_blocks(
        self, req_id: str, address: str, local_block_ids, remote_block_ids, *, timeout_s=None, expect=None
    ) -> TransferRecord:
        """Start copying the peer's `remote_block_ids` into local `local_block_ids` (same order). Non-blocking.

        `expect` is the (engine_id, incarnation) the peer must be. Returns the live record.
        """
        local, remote = self._read_ids(address, local_block_ids, remote_block_ids)
        timeout_s = self.transfer_timeout_s if timeout_s is None else timeout_s
        rec = self.tracker.start(req_id, address, timeout_s, payload=_Read(local, remote, expect))
        if address in self.peers and self.peers.get(address).is_instance(expect):
            self._post(rec)
        else:  # unknown, or another instance than expected: (re)handshake, then decide
            self.peers.start_handshake(address, refresh=address in self.peers)
        return rec

    def _read_ids(self, address: str, local_block_ids, remote_block_ids) -> tuple[np.ndarray, np.ndarray]:
        """A read's block ids as arrays; ValueError or IndexError now for ids no read can use, rather than a
        failed transfer later."""
        try:
            local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
            remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
        except OverflowError:
            raise ValueError("a block id does not fit in 64 bits") from None
        if local.shape != remote.shape and not self._translates(address):
            raise ValueError(f"{len(local)} local block ids but {len(remote)} remote block ids")
        self.layout.block_offsets(local)
        return local, remote

    def can_read_in_step(self, address: str, expect: tuple[str, str] | None = None) -> bool:
        """Whether a read from `address` (the instance `expect`) can go as device copies queued before
        the engine's next work (`read_blocks_in_step`): the peer is known, on this host's GPUs (a CUDA IPC
        mapping), one rank, and its pages are ours."""
        if self._ipc is None or address not in self.peers:
            return False
        peer = self.peers.get(address)
        return peer.is_instance(expect) and self.peers.mapping(address) is not None and not self.is_translated(peer)

    def in_step_peers(self) -> list[tuple[str, PeerInfo]]:
        """The known peers `can_read_in_step` holds for, with their addresses."""
        return [(a, self.peers.get(a)) for a in self.peers.addresses() if self.can_read_in_step(a)]

    def read_blocks_in_step(
        self, req_id: str, address: str, local_block_ids, remote_block_ids, *, expect: tuple[str, str]
    ) -> TransferRecord | None:
        """`read_blocks` for a synchronous load: CUDA IPC copies queued now, after the work already queued
        on this device's current stream, and ordered before the digest stream's next work. The caller
        makes the engine's stream wait for them (`hold_stream_for_digests`). None, with nothing queued,
        when the read cannot go that way (`can_read_in_step`, or too few runs of blocks for a copy).

        Stream order is the guarantee a synchronous load needs: whatever happens after, no byte of this
        read lands in the blocks once the engine's next work on the device has begun.
        """
        if not self.can_read_in_step(address, expect):
            return None
        local, remote = self._read_ids(address, local_block_ids, remote_block_ids)  # its pages are ours: one to one
        peer = self.peers.get(address)
        peer.layout.block_offsets(remote)  # IndexError for ids the peer does not have
        copy = self._ipc.start(TransferOp.READ, self.peers.mapping(address), peer.layout, local, remote)
        if copy is None:
            return None
        if self._digest_stream is not None:
            self._digest_stream.wait_event(copy.event)
        self.tracker.start(req_id, address, self.transfer_timeout_s, payload=_Read(local, remote, expect))
        return self.tracker.mark_posted(
            req_id, self.transfer_timeout_s, handle=copy, nbytes=len(local) * self.layout.block_nbytes,
            num_descriptors=copy.num_runs, copy_digests=copy.digests,
        )  # fmt: skip

    def hold_stream_for_digests(self) -> None:
        """The device's current stream waits for every digest queued so far (and the reads they
        follow): the engine's next forward pass may rewrite a slot of a block just read, and its
        digest must see the bytes as they landed."""
        if self._digest_stream is None:
            return
        import torch

        torch.cuda.current_stream(self._digest_stream.device).wait_stream(self._digest_stream)

    def wait_in_step_read(self, rec: TransferRecord) -> None:
        """Block until a read queued by `read_blocks_in_step` has landed, so this step's `poll` returns it."""
        if isinstance(rec.handle, IpcCopy):
            rec.handle.event.synchronize()

    def _post(self, rec: TransferRecord) -> None:
        read: _Read = rec.payload
        peer = self.peers.get(rec.peer)
        try:
            peer.layout.block_offsets(read.remote_ids)  # IndexError for ids the peer does not have
        except IndexError as e:  # the caller's ids are wrong, not the peer: keep it
            self.tracker.mark_failed(rec.req_id, f"IndexError: {e} (the peer has {peer.layout.num_blocks} blocks)")
            return
        if len(read.local_ids) != len(read.remote_ids) and not self.is_translated(peer):  # the caller's, again
            self.tracker.mark_failed(
                rec.req_id, f"ValueError: {len(read.local_ids)} local block ids but {len(read.remote_ids)} remote block "
                "ids, and the peer's pages are ours: pair them one to one"
            )  # fmt: skip
            return
        try:
            posted, num_descs = self._post_read(read, peer)
            if self._read_delay_s and not self.is_translated(peer) and not isinstance(posted, IpcCopy):
                # fault injection: its bytes land again past its deadline (transfer/delayed_post.py)
                pages = self.layout.page_offsets(read.local_ids)
                posted = DelayedPost(posted, self._region_bytes, pages, self.layout.page_nbytes, self._read_delay_s, self.tracker.clock)
        except (KVBridgeError, IndexError, ValueError) as e:
            self.tracker.mark_failed(rec.req_id, f"{type(e).__name__}: {e}")
            self.forget_peer(rec.peer)  # a post that fails with valid ids: the peer is gone or broken
            return
        # the record keeps its original deadline: handshake time counts against it
        remaining_s = max(0.0, rec.deadline - self.tracker.clock())
        nbytes = len(read.local_ids) * self.layout.block_nbytes
        self.tracker.mark_posted(rec.req_id, remaining_s, handle=posted, nbytes=nbytes, num_descriptors=num_descs,
                                 copy_digests=posted.digests if isinstance(posted, IpcCopy) else None)  # fmt: skip
        if posted is None:
            self.tracker.mark_done(rec.req_id)

    def _translates(self, address: str) -> bool:
        """Whether reads from `address` go through a plan (or may: the peer is not known yet)."""
        return address not in self.peers or self.is_translated(self.peers.get(address))

    def is_translated(self, peer: PeerInfo) -> bool:
        """Whether the peer's pages differ from ours (block size, page format, KV heads, several TP
        ranks): its reads are planned."""
        return peer.is_read_through_plan(self.shard)

    def _post_read(self, read: _Read, peer: PeerInfo) -> tuple[NixlPost | IpcCopy | None, int]:
        if len(read.local_ids) == 0 and len(read.remote_ids) == 0:
            return None, 0
        if self.is_translated(peer):
            if len(read.local_ids) == 0 or len(read.remote_ids) == 0:
                return None, 0  # no token has room on both sides
            return self._post_plan(read, peer)
        mapping = self.peers.mapping(peer.address) if self._ipc is not None else None
        copy = (
            self._ipc.start(TransferOp.READ, mapping, peer.layout, read.local_ids, read.remote_ids)
            if mapping is not None else None
        )  # fmt: skip
        if copy is not None:  # None: no mapping, or too few runs for it to pay; NIXL moves it
            return copy, copy.num_runs
        remote_list = self.peers.block_list(peer.address) if self._nixl.mode is DescriptorMode.BLOCKS else None
        post = self._nixl.post(TransferOp.READ, read.local_ids, read.remote_ids, peer, remote_list)
        return post, post.num_descriptors

    def _post_plan(self, read: _Read, peer: PeerInfo) -> tuple[NixlPost, int]:
        if self._is_per_layer:
            raise ConfigError(
                f"the KV of {peer.address} ({describe_layout(peer.layout)}) is laid out unlike ours "
                f"({describe_layout(self.layout)}), and reads translated between layouts are not supported into KV "
                "held one tensor per layer; serve both sides with the same block size, page format and TP size"
            )
        sources = peer.rank_shards()  # rank 0 first; one NIXL transfer per rank read from
        num_tokens = min(len(read.local_ids) * self.layout.block_size, len(read.remote_ids) * peer.layout.block_size)
        plan = plan_read(self.shard, read.local_ids, [s for _, _, s in sources], [read.remote_ids] * len(sources), num_tokens)
        post = self._nixl.post_plan(plan, [(name, region) for name, region, _ in sources])
        self.num_plans[plan.kind] += 1
        self.num_plan_descriptors += plan.num_descriptors
        if (peer.address, plan.kind) not in self._logged_plans:
            self._logged_plans.add((peer.address, plan.kind))
            logger.info(
                "reads from %s go through a %s plan (its KV: %s; ours: %s); first one: %s", peer.address,
                plan.kind.value, describe_layout(peer.layout), describe_layout(self.layout), plan.summary(),
            )  # fmt: skip
        return post, plan.num_descriptors

    def poll(self) -> list[TransferRecord]:
        """Advance every transfer without blocking; return (and forget) the records that became final.

        A quarantined read (expired in flight) is returned only once its transfer is over.
        """
        self._advance()
        final = [rec for rec in self.tracker.pop_final() if rec.req_id not in self._quarantine]
        final, self._unquarantined = final + self._unquarantined, []
        return final

    def _advance(self) -> None:
        self._finish_handshakes()
        for rec in self.tracker.live():
            if rec.state is TransferState.POSTED:
                handle = rec.handle
                state = self._poll(handle)
                if state is XferState.IN_PROGRESS:
                    continue
                gather_error = self._finish(handle) if state is XferState.DONE else None
                self._release(rec)
                if gather_error is not None:  # this read's fault only: its blocks are a load error
                    self.tracker.mark_failed(rec.req_id, f"the staged read from {rec.peer} could not be gathered: {gather_error}")
                elif state is XferState.DONE:
                    self.tracker.mark_done(rec.req_id)
                    if isinstance(handle, IpcCopy):
                        rec.device_s = handle.device_seconds()
                    if isinstance(handle, NixlPost):
                        self._connected.add(rec.peer)
                else:
                    self.tracker.mark_failed(rec.req_id, f"NIXL reported a failed READ from {rec.peer}")
                    self.forget_peer(rec.peer)
        for rec in self.tracker.expire_overdue():
            if isinstance(rec.handle, (NixlPost, DelayedPost)) and self._poll(rec.handle) is XferState.IN_PROGRESS:
                self._quarantine_read(rec)
            else:
                self._release(rec)
        self._end_quarantines()
        for address in [a for a in self._to_forget if not self._reads_from(a)]:
            self.forget_peer(address)
        self.peers.drop_handshakes({r.peer for r in self.tracker.live() if r.state is TransferState.HANDSHAKING})

    def _finish_handshakes(self) -> None:
        for address, error in self.peers.finish_handshakes().items():
            for rec in self.tracker.live():
                if rec.peer == address and rec.state is TransferState.HANDSHAKING:
                    self.tracker.mark_failed(rec.req_id, f"{type(error).__name__}: {error}")
        for rec in self.tracker.live():
            if rec.state is not TransferState.HANDSHAKING or self.peers.is_handshaking(rec.peer):
                continue
            if rec.peer not in self.peers:  # its handshake failed before this record was started
                self.tracker.mark_failed(rec.req_id, f"the handshake with {rec.peer} failed")
            elif self.peers.get(rec.peer).is_instance(rec.payload.expect):
                self._post(rec)
            else:
                info = self.peers.get(rec.peer)
                self.tracker.mark_failed(
                    rec.req_id,
                    f"{rec.peer} is engine {info.engine_id} incarnation {info.incarnation}, not the instance "
                    f"{rec.payload.expect} the transfer was meant for: it restarted, or the params are stale or forged",
                )

    def _finish(self, handle: NixlPost | IpcCopy | DelayedPost) -> str | None:
        """A staged plan's gather into our pages once its read is done; why it failed, if it did."""
        if isinstance(handle, DelayedPost):
            handle = handle.posted
        if not isinstance(handle, NixlPost):
            return None
        try:
            self._nixl.finish(handle, self._region_bytes)
        except (RuntimeError, ValueError, IndexError) as e:
            logger.error("a staged read's gather failed: %s: %s", type(e).__name__, e)
            return f"{type(e).__name__}: {e}"
        return None

    def _quarantine_read(self, rec: TransferRecord) -> None:
        self._quarantine[rec.req_id] = (rec, self.tracker.clock(), self._peer_instance(rec.peer))
        self.num_quarantined_reads += 1
        if rec.peer not in self._connected:
            self.num_quarantined_first_reads += 1
        logger.warning(
            "read %s from %s expired while NIXL still runs it: its %d destination blocks stay quarantined until "
            "NIXL ends it or the peer restarts%s", rec.req_id, rec.peer, len(rec.payload.local_ids),
            "" if rec.peer in self._connected else (
                "; no read from this peer has completed yet: NIXL reports a first read done only once the peer's UCX "
                "worker has answered the new connection, so the peer's NIXL progress thread is the first suspect"
            ),
        )  # fmt: skip

    def _end_quarantines(self) -> None:
        """End the quarantines whose late writes are ruled out, and only those: NIXL reports the read over
        while the peer instance it was posted to is still the one registered (the transfer really ended),
        or that instance is gone (another one answers at its address: the process whose registration the
        read targeted closed its endpoint). No clock ends one: neither releasing a NIXL transfer nor
        removing the peer's agent stops its bytes (measured over UCX's TCP transport, where they land
        once the stalled peer resumes; tests/transfer/test_endpoint.py), so a block is never handed out
        again while a late write may still hit it. A quarantine past `transfer_timeout_s` is logged
        and counted once (`num_quarantine_timeouts`); its request stays parked until it ends, or until
        its client aborts it (the scheduler then holds the blocks until the record is reported)."""
        now = self.tracker.clock()
        for req_id, (rec, since, instance) in list(self._quarantine.items()):
            is_over = self._poll(rec.handle) is not XferState.IN_PROGRESS
            current = self._peer_instance(rec.peer)
            is_gone = current != instance and current != ("", "")  # another instance registered at that address
            if not (is_over and (current == instance or is_gone)):
                if now - since >= self.transfer_timeout_s and req_id not in self._overdue:
                    self._overdue.add(req_id)
                    self.num_quarantine_timeouts += 1
                    logger.error(
                        "read %s from %s: NIXL still runs it %.0fs after it expired; its %d blocks stay withheld "
                        "until NIXL ends it or the peer restarts (a late write into them cannot be ruled out "
                        "before): look at the peer", req_id, rec.peer, now - since, len(rec.payload.local_ids),
                    )  # fmt: skip
                continue
            self._release(rec)
            del self._quarantine[req_id]
            self._overdue.discard(req_id)
            self._unquarantined.append(rec)

    def _peer_instance(self, address: str) -> tuple[str, str]:
        info = self.peers.get(address) if address in self.peers else None
        return (info.agent_name, info.incarnation) if info is not None else ("", "")

    @property
    def num_quarantined(self) -> int:
        """Reads quarantined now (expired while NIXL still ran them): their blocks are not released yet."""
        return len(self._quarantine)

    def _poll(self, handle: NixlPost | IpcCopy | DelayedPost) -> XferState:
        if isinstance(handle, DelayedPost):
            return handle.poll(self.agent)
        if isinstance(handle, IpcCopy):
            if self._wait_ipc_reads:
                handle.event.synchronize()  # the copy alone: its stream waits for nothing queued after it
            return XferState.DONE if handle.is_done() else XferState.IN_PROGRESS
        return poll_post(self.agent, handle)

    def _sync_ipc_copies(self) -> None:
        if self._ipc is not None:
            self._ipc.synchronize()

    def _release(self, rec: TransferRecord) -> None:
        handle, rec.handle = rec.handle, None
        if isinstance(handle, DelayedPost):
            handle = handle.posted
        if isinstance(handle, IpcCopy):
            # An enqueued copy cannot be cancelled: an expired one still writes its blocks, so wait
            # for it (milliseconds) before anyone may reuse them.
            handle.event.synchronize()
        elif handle is not None:
            self._nixl.release(handle)

    # ------------------------------------------------------------------ digests

    def digest_blocks(self, block_ids, alg: str | None = None) -> m.KVDigest:
        """Digest of each block's bytes (all layers), on the KV tensor's device; `alg` None: this
        endpoint's own algorithm. Raises DigestError or IndexError (transfer/digest.py)."""
        return block_digests(self._region_bytes, self.layout, block_ids, alg or self.digest_alg)

    def _on_digest_stream(self):
        """Digests of leased or landed blocks run on a stream of their own (on a GPU): they read blocks
        whose bytes are in place (written by steps whose outputs were taken, or landed), so they need
        not wait for a forward pass the engine queued meanwhile, and nothing waits for them but their
        result."""
        if self._digest_stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self._digest_stream)

    def digest_lease(self, block_ids, per_head: bool = True) -> m.KVDigest:
        """What an owner returns with a lease: each block's digest and, when our pages hold several KV
        heads, each head's (so a reader holding only some of them, a wider tensor-parallel decode, can
        check what it read). Raises DigestError or IndexError. On the digest stream."""
        with self._on_digest_stream():
            return self._digest_lease(block_ids, per_head)

    def _digest_lease(self, block_ids, per_head: bool) -> m.KVDigest:
        if self._digest_defect:
            raise RuntimeError("fault injection (KVBRIDGE_FAULT_DIGEST_DEFECT): a defect in the lease digests")
        if not per_head:
            return self.digest_blocks(block_ids)
        return lease_digests(self._region_bytes, self.layout, block_ids, self.digest_alg)

    @staticmethod
    def _head_shard(shard: KVShard, head: int) -> KVShard:
        """One KV head of `shard`'s pages, as pages of its own."""
        return KVShard(dataclasses.replace(shard.layout, num_kv_heads=1), head, shard.total_kv_heads)

    def start_digest(self, block_ids, alg: str) -> DigestJob:
        """`digest_blocks` without waiting for the device: `result()` waits (a GPU's work is queued)."""
        return start_block_digests(self._region_bytes, self.layout, block_ids, alg)

    def start_read_digest(self, address: str, local_block_ids, remote_block_ids, alg: str) -> DigestJob:
        """Digests of the peer's blocks `remote_block_ids` as this node holds them after reading them into
        `local_block_ids`: what the peer's own digests of those blocks must equal.

        Same pages on both sides: our blocks' digests. Translated (another block size or page format):
        the peer's blocks are rebuilt in its page format from our pages (the inverse of the read plan,
        one gather into a scratch buffer on our device) and digested, so the check covers the bytes
        where they landed, gather included. Raises DigestError when our blocks do not hold all of the
        peer's blocks' tokens (a larger remote block whose tail we have no room for): unverifiable.
        """
        return self.start_read_digests(address, local_block_ids, remote_block_ids, alg)[0][0][1]

    def start_read_digests(
        self, address: str, local_block_ids, remote_block_ids, alg: str
    ) -> list[list[tuple[int | None, DigestJob]]]:
        """`start_read_digest` for each rank of a tensor-parallel peer node (rank 0 first): per rank, the
        digests of what we read from it, as (None, its whole blocks) when we hold all of its heads, else
        (i, its i-th head's blocks) for each of its heads we hold (to check against its `head_values`),
        and nothing for a rank none of whose heads we hold (nothing was read from it). On the digest stream."""
        with self._on_digest_stream():
            return self._start_read_digests(address, local_block_ids, remote_block_ids, alg)

    def _start_read_digests(
        self, address: str, local_block_ids, remote_block_ids, alg: str
    ) -> list[list[tuple[int | None, DigestJob]]]:
        peer = self.peers.get(address) if address in self.peers else None
        if peer is None or not self.is_translated(peer):
            return [[(None, self.start_digest(local_block_ids, alg))]]
        num_remote = len(np.asarray(remote_block_ids).reshape(-1))
        mine = self.shard
        per_rank: list[list[tuple[int | None, DigestJob]]] = []
        for _, _, theirs in peer.rank_shards():
            first, end = max(theirs.head_start, mine.head_start), min(theirs.head_end, mine.head_end)
            if (first, end) == (theirs.head_start, theirs.head_end):
                parts = [(None, theirs)]  # we hold every head of its pages
            else:
                parts = [(head - theirs.head_start, self._head_shard(theirs, head)) for head in range(first, end)]
            jobs = []
            for index, shard in parts:
                try:
                    blocks, layout = rebuild_blocks(self._region_bytes, mine, local_block_ids, shard, num_remote)
                except ValueError as e:
                    raise DigestError(f"the peer's blocks cannot be digested here: {e}") from None
                if index is None:
                    jobs.append((index, start_block_digests(blocks, layout, np.arange(num_remote), alg)))
                else:  # one head of theirs: as `lease_digests` digests it (wsum64: with its words' whole-block multipliers)
                    values = head_block_digests(blocks, layout, theirs.layout, index, alg)
                    jobs.append((index, DigestJob(alg, values=values)))
            per_rank.append(jobs)
        return per_rank

    def flip_bit(self, block_id: int) -> None:
        """Fault injection (env.fault_flip_read_bit): flip the lowest bit of block `block_id`'s first byte."""
        offset = self.layout.block_offset(block_id)
        region = self._kv.layer_span(0) if self._is_per_layer else self._region_bytes
        region[offset : offset + 1] ^= 1
        if self._digest_stream is not None:  # in place before the digest stream reads it
            import torch

            self._digest_stream.wait_stream(torch.cuda.current_stream(self._kv.device))

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> dict:
        t = self.tracker
        return {
            "num_done": t.num_done,
            "num_failed": t.num_failed,
            "bytes_done": t.bytes_done,
            "num_live": t.num_live,
            "num_peers": len(self.peers),
            "num_ipc_copies": self._ipc.num_copies if self._ipc is not None else 0,
            "num_quarantined": self.num_quarantined,
            "num_quarantined_reads": self.num_quarantined_reads,
            "num_quarantine_timeouts": self.num_quarantine_timeouts,
            "num_quarantined_first_reads": self.num_quarantined_first_reads,
            "num_process_stalls": self.stall_watch.num_stalls,
            "max_process_stall_s": round(self.stall_watch.max_stall_s, 3),
            "num_direct_plan_reads": self.num_plans[PlanKind.DIRECT],
            "num_staged_plan_reads": self.num_plans[PlanKind.STAGED],
            "num_plan_descriptors": self.num_plan_descriptors,
        }

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop serving, release every transfer and list, deregister the KV tensor, drop it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stall_watch.stop()
        if self.server is not None:
            self.server.close()
        for rec in [*self.tracker.live(), *(entry[0] for entry in self._quarantine.values())]:
            self._release(rec)
        self._quarantine.clear()
        self._sync_ipc_copies()
        self.peers.close()  # closes CUDA IPC mappings too
        self.agent.close()  # releases lists and peers, then deregisters before the tensor can go
        self._nixl.close()
        self._kv = self._region_bytes = None
