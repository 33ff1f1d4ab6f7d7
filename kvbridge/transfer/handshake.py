"""Both halves of the handshake as pure functions (no sockets, no NIXL), plus what a reader keeps.

Owner of the KV (server thread): `answer_handshake(request, identity)` checks the protocol
version range and the compatibility hash and returns the `HandshakeResponse`, or raises
`IncompatiblePeerError` (sent back as `ErrorReply(INCOMPATIBLE)`).

Reader: `peer_from_response(response, address, expected_hash, local_layout, model_hash)` re-checks
the answer and turns it into a `PeerInfo`: everything needed to build descriptors for that peer.

Two engines pair when their compat hashes agree (same pages: reads are block or page copies) or,
when the reader translates layouts (it sends its `model_hash`), when their model hashes agree: the
peer's block size, page format and placement may then differ from ours, and the reader plans each
read (transfer/layout_plan.py). Anything else is refused with both layouts named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvbridge.errors import ConfigError, HandshakeError, IncompatiblePeerError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.kv_shard import KVShard


@dataclass(frozen=True)
class LocalIdentity:
    """What an engine tells peers about itself in a handshake response."""

    engine_id: str
    incarnation: str  # random per endpoint: tells a restarted engine from the one before
    compat_hash: str
    agent_name: str
    agent_metadata: bytes
    region: m.KVRegion
    layout: KVCacheLayout
    cuda_ipc: m.IpcExport | None = None  # the KV tensor's CUDA IPC export, when offered
    digest_alg: str = ""  # what this engine digests its leased blocks with
    model_hash: str = ""  # KVCacheLayout.model_hash: set when this engine translates layouts (and accepts readers that do)
    kv_head_start: int = 0  # tensor parallelism: the first global KV head this rank's pages hold
    num_total_kv_heads: int = 0  # the model's KV heads (0: layout.num_kv_heads, tensor parallel 1)
    ranks: tuple[m.RankShard, ...] = ()  # the node's other ranks, when this is the rank 0 of a TP node
    grant_key: bytes = b""  # what this engine signs lease grants with (transfer/grants.py), given to readers

    @property
    def shard(self) -> KVShard:
        return KVShard(self.layout, self.kv_head_start, self.num_total_kv_heads or None)


@dataclass(frozen=True)
class PeerRank:
    """Another tensor-parallel rank of a peer node (m.RankShard, validated): its agent, region and heads."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    region: m.KVRegion
    shard: KVShard


@dataclass(frozen=True)
class PeerInfo:
    """A remote engine after a successful handshake (cached per address by KVEndpoint)."""

    address: str
    engine_id: str
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    protocol_version: int
    region: m.KVRegion
    layout: KVCacheLayout  # the local model geometry with the peer's block count, block size, page format and strides
    cuda_ipc: m.IpcExport | None = None  # the peer's CUDA IPC export, if it offered one
    digest_alg: str = ""  # the peer's digest algorithm for its leased blocks ("": not said)
    kv_head_start: int = 0  # tensor parallelism: the global KV heads of `layout` start here
    num_total_kv_heads: int = 0  # the model's KV heads (0: layout.num_kv_heads)
    ranks: tuple[PeerRank, ...] = ()  # the peer node's other tensor-parallel ranks
    grant_key: bytes = b""  # the key the peer signs its lease grants with (b"": it signs none)

    @property
    def shard(self) -> KVShard:
        """This peer's (its rank 0's) pages as the layout translator sees them."""
        return KVShard(self.layout, self.kv_head_start, self.num_total_kv_heads or None)

    def rank_shards(self) -> list[tuple[str, m.KVRegion, KVShard]]:
        """(agent name, region, shard) of every rank of the peer node, rank 0 first."""
        return [(self.agent_name, self.region, self.shard)] + [(r.agent_name, r.region, r.shard) for r in self.ranks]

    def is_read_through_plan(self, mine: KVShard) -> bool:
        """Whether reads from this peer into `mine` go through a layout plan: its pages differ from ours
        (block size, page format), its heads do, or it is a node of several ranks."""
        theirs = self.shard
        return (
            bool(self.ranks)
            or self.layout.geometry_key() != mine.layout.geometry_key()
            or (theirs.head_start, theirs.total_kv_heads) != (mine.head_start, mine.total_kv_heads)
        )

    def is_instance(self, expect: tuple[str, str] | None) -> bool:
        """Whether this is the engine instance `(engine_id, incarnation)` (None: any)."""
        return expect is None or expect == (self.engine_id, self.incarnation)


def make_request(me: LocalIdentity) -> m.HandshakeRequest:
    return m.HandshakeRequest(
        protocol_version=m.PROTOCOL_VERSION,
        min_protocol_version=m.MIN_PROTOCOL_VERSION,
        engine_id=me.engine_id,
        compat_hash=me.compat_hash,
        agent_name=me.agent_name,
        model_hash=me.model_hash,
        layout_description=describe_layout(me.layout),
    )


def answer_handshake(req: m.HandshakeRequest, me: LocalIdentity) -> m.HandshakeResponse:
    """The response to `req`, or IncompatiblePeerError. Called on the side-channel server thread."""
    version = m.negotiate_version(req.protocol_version, req.min_protocol_version)
    same_model = bool(req.model_hash) and req.model_hash == me.model_hash  # the reader translates layouts
    if req.compat_hash != me.compat_hash and not same_model:
        raise IncompatiblePeerError(
            f"engine {req.engine_id!r} has compat hash {req.compat_hash}, engine {me.engine_id!r} has "
            f"{me.compat_hash}: the model, dtype or KV geometry differ (theirs: {req.layout_description or 'not said'}; "
            f"ours: {describe_layout(me.layout)}); run the same model and kv dtype on both"
        )
    if version < m.STRIDED_LAYOUT_VERSION and not me.layout.is_contiguous:
        raise IncompatiblePeerError(
            f"engine {req.engine_id!r} speaks kvbridge protocol {version}, which cannot describe the strided KV "
            f"layout of engine {me.engine_id!r}; upgrade it to protocol {m.STRIDED_LAYOUT_VERSION} or later"
        )
    return m.HandshakeResponse(
        protocol_version=version,
        engine_id=me.engine_id,
        incarnation=me.incarnation,
        compat_hash=me.compat_hash,
        agent_name=me.agent_name,
        agent_metadata=me.agent_metadata,
        regions=[me.region],
        num_blocks=me.layout.num_blocks,
        block_nbytes=me.layout.block_nbytes,
        cuda_ipc=me.cuda_ipc,
        page_format=me.layout.page_format,
        layer_stride=me.layout.layer_stride,
        block_stride=me.layout.block_stride,
        digest_alg=me.digest_alg,
        model_hash=me.model_hash,
        block_size=me.layout.block_size,
        kv_head_start=me.kv_head_start,
        num_kv_heads=me.layout.num_kv_heads,
        num_total_kv_heads=me.num_total_kv_heads,
        ranks=list(me.ranks),
        grant_key=me.grant_key,
    )


def peer_from_response(
    resp: m.Message, address: str, expected_hash: str, local_layout: KVCacheLayout, model_hash: str = ""
) -> PeerInfo:
    """Validate a handshake answer. Raises IncompatiblePeerError or HandshakeError.

    `model_hash`: ours, when we translate layouts: a peer of the same model with another block
    size or page format is accepted then (its `PeerInfo.layout` says how its pages differ)."""
    if not isinstance(resp, m.HandshakeResponse):
        raise HandshakeError(f"peer {address} answered a handshake with {type(resp).__name__}")
    version = m.negotiate_version(resp.protocol_version, resp.protocol_version)
    translated = resp.compat_hash != expected_hash
    if len(resp.regions) != 1:
        raise HandshakeError(f"peer {address} sent {len(resp.regions)} KV regions; this build expects exactly one")
    region = resp.regions[0]
    if translated and not (model_hash and resp.model_hash == model_hash):
        theirs = (
            f"{resp.page_format} pages, {resp.block_size or 'unsaid'}-token blocks of {resp.block_nbytes} B, "
            f"model hash {resp.model_hash or 'not sent'}"
        )  # its model geometry is not on the wire: only its hash
        raise IncompatiblePeerError(
            f"peer {address} (engine {resp.engine_id!r}) has compat hash {resp.compat_hash}, ours is {expected_hash}: "
            f"its KV ({theirs}) and ours ({describe_layout(local_layout)}, model hash {model_hash or 'not used'}) are not "
            "of one model, dtype and KV geometry; serve the same checkpoint and kv dtype on both"
        )
    layout = _peer_layout(resp, address, local_layout)
    if resp.block_nbytes != layout.block_nbytes:
        raise IncompatiblePeerError(
            f"peer {address} has {resp.block_nbytes}-byte blocks, but its layout ({describe_layout(layout)}) makes "
            f"them {layout.block_nbytes} B; ours: {describe_layout(local_layout)}"
        )
    if not translated and resp.page_format != local_layout.page_format:
        raise IncompatiblePeerError(
            f"peer {address} has {resp.page_format!r} KV pages, ours are {local_layout.page_format!r}"
        )
    why = region_mismatch(region, layout)
    if why:
        raise HandshakeError(f"peer {address} claims {resp.num_blocks} blocks of {resp.block_nbytes} B, but {why}")
    if not resp.agent_name or not resp.agent_metadata:
        raise HandshakeError(f"peer {address} sent no NIXL agent name or metadata")
    if not resp.incarnation:
        raise HandshakeError(f"peer {address} sent no incarnation")
    return PeerInfo(
        address=address,
        engine_id=resp.engine_id,
        incarnation=resp.incarnation,
        agent_name=resp.agent_name,
        agent_metadata=resp.agent_metadata,
        protocol_version=version,
        region=region,
        layout=layout,
        cuda_ipc=resp.cuda_ipc,
        grant_key=resp.grant_key,
        digest_alg=resp.digest_alg,
        kv_head_start=resp.kv_head_start,
        num_total_kv_heads=resp.num_total_kv_heads,
        ranks=_peer_ranks(resp, address, layout),
    )


def region_mismatch(region: m.KVRegion, layout: KVCacheLayout) -> str | None:
    """Why `region` cannot hold `layout`'s pages, or None: one region spanning them all, or (KV held
    one layer per allocation) one region per layer at the layout's layer stride, each spanning a layer."""
    if not region.layer_addrs:
        if region.nbytes < layout.region_nbytes:
            return f"they span {layout.region_nbytes} B in a {region.nbytes}-byte region"
        return None
    if len(region.layer_addrs) != layout.num_layers or region.layer_stride != layout.layer_stride_bytes:
        return (
            f"it sent {len(region.layer_addrs)} layer regions at a layer stride of {region.layer_stride} B for "
            f"{layout.num_layers} layers at {layout.layer_stride_bytes} B"
        )
    if region.nbytes < layout.layer_region_nbytes or region.layer_addrs[0] != region.base_addr:
        return f"a layer's pages span {layout.layer_region_nbytes} B in a {region.nbytes}-byte layer region"
    return None


def _peer_ranks(resp: m.HandshakeResponse, address: str, layout: KVCacheLayout) -> tuple[PeerRank, ...]:
    """The peer node's other ranks, their pages laid out as its rank 0's with their own head counts."""
    ranks = []
    for r in resp.ranks:
        try:
            rank_layout = dataclasses.replace(layout, num_kv_heads=r.num_kv_heads)
            shard = KVShard(rank_layout, r.kv_head_start, resp.num_total_kv_heads or None)
        except ConfigError as e:
            raise HandshakeError(f"peer {address} described an invalid KV layout for its rank {r.rank}: {e}") from None
        if region_mismatch(r.region, rank_layout) or not r.agent_name or not r.agent_metadata:
            raise HandshakeError(f"peer {address} described its rank {r.rank} without a NIXL agent or a large enough region")
        ranks.append(PeerRank(r.rank, r.agent_name, r.agent_metadata, r.region, shard))
    return tuple(ranks)


def _peer_layout(resp: m.HandshakeResponse, address: str, local_layout: KVCacheLayout) -> KVCacheLayout:
    """Our model geometry with the peer's block count, block size (0: ours), page format and strides,
    or HandshakeError when they are invalid."""
    if resp.num_blocks <= 0:
        raise HandshakeError(f"peer {address} claims {resp.num_blocks} blocks")
    try:
        return dataclasses.replace(
            local_layout, num_blocks=resp.num_blocks, block_size=resp.block_size or local_layout.block_size,
            page_format=resp.page_format, layer_stride=resp.layer_stride, block_stride=resp.block_stride,
            num_kv_heads=resp.num_kv_heads or local_layout.num_kv_heads,
        )
    except ConfigError as e:
        raise HandshakeError(f"peer {address} described an invalid KV layout: {e}") from None


def describe_layout(layout: KVCacheLayout) -> str:
    """A layout in words, for errors and logs (that of a whole engine: tensor parallel 1)."""
    return KVShard(layout).describe()
