"""Every message that crosses a process boundary in the transfer layer, as tagged msgspec Structs.

Wire format: msgpack. Each message is a `msgspec.Struct` tagged with a short string in the
`type` field; `encode` and `decode` are the only way in and out (one module-level encoder, one
typed decoder over the `Message` union), and receivers dispatch with `match`:

    match decode(data):
        case HandshakeRequest() as req: ...
        case TransferDone(req_ids=ids): ...

The side channel wraps every encoded message in a `Frame` (correlation id, nonce, timestamp and
an optional HMAC, see `auth.py`); nothing on the wire is ever a pickle.

Schema evolution (checked by tests/transfer/test_messages.py):
- a new field always gets a default, so an old peer's message still decodes;
- unknown fields are ignored, so a new peer's message still decodes on an old peer;
- never rename or remove a field, change its type, or reuse a tag;
- a new message type is a new tag: an old peer answers it with `ErrorReply(MALFORMED)`;
- anything else is a breaking change: bump `PROTOCOL_VERSION` (and `MIN_PROTOCOL_VERSION` when
  the old format can no longer be spoken). The handshake accepts a peer when the two
  [min, max] version ranges overlap and both sides then speak the lower maximum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import msgspec

from kvbridge.errors import IncompatiblePeerError, MalformedMessageError

if TYPE_CHECKING:
    from kvbridge.kv_transfer_params import RemotePrefillParams

# 2: leases are named by (request id, token, block ids, block hash) under the owner's incarnation;
# the handshake carries the incarnation. Version 1 named leases by request id alone, which any
# peer could guess: it is no longer spoken.
# 3: the handshake answer carries the owner's page format and strides (strided KV layouts such as
# vLLM's). A version 2 reader would ignore them and place block b at b * block_nbytes, so an owner
# whose layout is not block-major refuses version 2; block-major owners still speak it.
PROTOCOL_VERSION = 3  # what this build speaks
MIN_PROTOCOL_VERSION = 2  # the oldest version this build still understands
STRIDED_LAYOUT_VERSION = 3  # the first version that can describe a layout that is not block-major


class _Message(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of every tagged message. Never encoded on its own."""


class KVRegion(msgspec.Struct, frozen=True, kw_only=True):
    """One registered KV memory region of an engine: every page of its KV cache.

    Page (layer l, block b) lives at `base_addr + l * layer_stride + b * block_stride`, with the
    handshake's strides (block-major by default: block b is `block_nbytes` bytes at
    `base_addr + b * block_nbytes`). `mem_type` is NIXL's name: "DRAM" (host) or "VRAM" (GPU).
    """

    base_addr: int
    nbytes: int
    device_id: int = 0
    mem_type: str = "DRAM"
    # KV held one layer per allocation (vLLM 0.25's V2 model runner): each layer's pages in a region
    # of its own, registered at once. Layer l's region starts at layer_addrs[l] (base_addr is layer 0's)
    # and spans `nbytes`; the layout's offset o lies at layer_addrs[o // layer_stride] + o % layer_stride
    # (transfer/descriptors.py). Empty: one region.
    layer_addrs: tuple[int, ...] = ()
    layer_stride: int = 0


class IpcExport(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU KV tensor exported through CUDA IPC, for readers on the same host (transfer/cuda_ipc.py)."""

    host_id: str  # the kernel's boot id: the same host
    pid: int  # readers in this process use the tensor directly, not a mapping
    handle: bytes  # CUipcMemHandle of the allocation holding the KV tensor (64 bytes)
    offset: int  # KV tensor start inside that allocation
    nbytes: int
    device_uuid: str = ""  # the GPU holding it (ordinals differ between processes; UUIDs do not)


class RankShard(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor-parallel rank of a KV owner other than the one answering (its rank 0): its own NIXL
    agent and registered KV region, and which global KV heads its pages hold. Its pages are rank 0's
    in every other respect (block ids, block size, page format, strides): the ranks of a node share
    block ids, so a lease on rank 0's blocks covers every rank's copy of them."""

    rank: int
    agent_name: str
    agent_metadata: bytes
    region: KVRegion
    kv_head_start: int
    num_kv_heads: int


class HandshakeRequest(_Message, tag="hs_req"):
    """Reader -> owner of KV: "tell me how to read your blocks". Sent once per remote engine.

    `compat_hash` is `KVCacheLayout.compat_hash(model_id)`; a mismatch is refused with
    `ErrorReply(INCOMPATIBLE)`. The requester's own agent name/metadata are informative (logs);
    the server never loads them.
    """

    protocol_version: int
    engine_id: str
    compat_hash: str
    min_protocol_version: int = 1
    agent_name: str = ""
    agent_metadata: bytes = b""
    # `KVCacheLayout.model_hash(model_id)` when the reader translates layouts (transfer/layout_plan.py):
    # the owner then accepts another compat_hash (block size, page format) of the same model.
    # "": an older reader, held to the same compat_hash.
    model_hash: str = ""
    # The requester's KV layout in words (informative): a refusal names both layouts.
    layout_description: str = ""


class HandshakeResponse(_Message, tag="hs_resp"):
    """Owner of KV -> reader: everything needed to build NIXL descriptors locally.

    `protocol_version` is the version both sides speak from now on (the negotiated one).
    """

    protocol_version: int
    engine_id: str
    compat_hash: str
    agent_name: str
    agent_metadata: bytes  # nixl get_agent_metadata(); loaded with add_remote_agent
    # Random per owner process: a reader checks it against the kv_transfer_params it was given, so
    # blocks leased by a process that has since restarted on the same address are never read.
    incarnation: str
    regions: list[KVRegion]
    num_blocks: int
    block_nbytes: int
    # The KV tensor's CUDA IPC export when it is on a GPU and the owner offers it: readers on the
    # same host may map it instead of going through NIXL. Added with a default: old peers ignore it.
    cuda_ipc: IpcExport | None = None
    # The owner's KVCacheLayout.page_format, layer_stride and block_stride (bytes; 0 and 0:
    # block-major). Added in version 3; the defaults describe every version 2 owner.
    page_format: str = "2NHD"
    layer_stride: int = 0
    block_stride: int = 0
    # The algorithm the owner digests leased blocks with (transfer/digest.py), so a reader can digest
    # what it read as soon as it lands. "": an older owner; the reader then digests on confirmation.
    digest_alg: str = ""
    # The owner's model hash and tokens per block, for readers that translate layouts. "" and 0:
    # an older owner, whose block size is the reader's (its compat_hash matched).
    model_hash: str = ""
    block_size: int = 0
    # Tensor parallelism: the global KV heads this rank's pages hold, [kv_head_start, kv_head_start +
    # num_kv_heads) of the model's num_total_kv_heads (0, 0, 0: an older owner holding every head), and
    # the node's other ranks (`RankShard`), whose heads a reader may need as well. One side channel
    # answers for the node: its leases, digests and releases cover every rank.
    kv_head_start: int = 0
    num_kv_heads: int = 0
    num_total_kv_heads: int = 0
    ranks: list[RankShard] = []
    # The key the owner signs its lease grants with (transfer/grants.py): a reader that holds it checks
    # a grant carried in kv_transfer_params and uses what it read without asking the owner. b"": an
    # older owner, or one that grants in its next step; readers then confirm each read on this channel.
    grant_key: bytes = b""


class LeaseRef(msgspec.Struct, frozen=True, kw_only=True):
    """One lease on an owner's blocks, named the way only its requester can name it.

    `req_id` is the owner's request id, `token` the unguessable secret the owner returned with the
    request's kv_transfer_params, `block_ids` the leased blocks (in token order) and `block_hash`
    the chained hash (hex) of the last of them. The owner acts on a lease only when all four match
    exactly; anything else is "unknown".
    """

    req_id: str
    token: str
    block_ids: list[int]
    block_hash: str

    @classmethod
    def of(cls, params: RemotePrefillParams) -> LeaseRef:
        """The lease that a decode node's kv_transfer_params name, as renewals and releases name it."""
        return cls(
            req_id=params.remote_request_id,
            token=params.remote_lease_token,
            block_ids=list(params.remote_block_ids),
            block_hash=params.remote_block_hash,
        )


class LeaseRenew(_Message, tag="lease2"):
    """Reader -> owner: "I still intend to read these leases' blocks; keep them a while longer".

    `incarnation` is the owner process the reader believes it talks to (from kv_transfer_params);
    an owner with another incarnation answers every lease "unknown".
    """

    engine_id: str
    incarnation: str
    leases: list[LeaseRef]


class LeaseRenewReply(_Message, tag="lease2_ok"):
    """The owner's answer per request id.

    `held`: the lease matched and is extended. `pending`: the owner has not granted that request's
    lease yet (it does so at its next engine step; its blocks are still allocated), ask again.
    `unknown`: no lease matches (made-up, expired, released, or another incarnation's).
    """

    held: list[str] = []
    pending: list[str] = []
    unknown: list[str] = []


class TransferDone(_Message, tag="done2"):
    """Reader -> owner: these leases' blocks were read (`leases`) or abandoned (`failed_leases`).

    The owner releases a lease only on an exact match (see LeaseRef) and says, per request id,
    whether the read was covered by the lease from start to end.
    """

    engine_id: str
    incarnation: str
    leases: list[LeaseRef] = []
    failed_leases: list[LeaseRef] = []
    # Tensor parallelism on the reader: every rank reads its own heads and confirms for itself; the
    # owner releases a lease once `num_readers` distinct `reader_rank`s have confirmed or abandoned it.
    reader_rank: int = 0
    num_readers: int = 1


class KVDigest(msgspec.Struct, frozen=True, kw_only=True):
    """Digests of leased blocks' bytes, one per block in the lease's order (transfer/digest.py).

    `alg` names the algorithm ("xxh3-64", "wsum64"); `values` are unsigned 64-bit integers.
    """

    alg: str
    values: list[int]
    # Per KV head of the digested pages, in head order, each in `values`' order: what a reader holding
    # only some of those heads checks (tensor parallelism, decode wider than prefill), as
    # transfer/head_digests.py defines them (wsum64: the head's share of the block's sum, so a block's
    # heads add up to its value). []: not taken (pages of one head, whose `values` are that head's).
    head_values: list[list[int]] = []
    # Tensor parallelism: the digests of the owner's ranks 1..N-1 (each rank digests its own heads of
    # the leased blocks when the lease is granted; rank 0 holds the lease and answers for all). []: one rank.
    ranks: list[KVDigest] = []


class LeaseGrant(msgspec.Struct, frozen=True, kw_only=True):
    """An owner's word on a lease, given when the request finished there and carried to the reader in
    kv_transfer_params (transfer/grants.py signs and opens it): these blocks, of this owner instance,
    hold these bytes, and stay held until `expires_at` (the owner's wall clock, seconds since the
    epoch) unless released. The reader digests what it read and compares; it asks the owner nothing.
    """

    lease: LeaseRef
    incarnation: str
    expires_at: float
    digest: KVDigest



class RankDigests(_Message, tag="tp_digests"):
    """A tensor-parallel rank > 0 -> its rank 0, in the step it granted leases (through the engine's
    rank group, engine/tp_connector.py): the digest of its own heads of each newly leased request's
    blocks, taken at grant. A request missing here could not be digested on that rank."""

    digests: dict[str, KVDigest] = {}


class TransferDoneReply(_Message, tag="done2_ok"):
    """Owner -> reader, answering `TransferDone`, per request id.

    `released`: the lease matched and was held until now, so a read made under it saw the
    leased blocks unchanged. `pending`: the lease is not granted yet; send it again shortly.
    `unknown`: no lease matches; a read made under it cannot be vouched for (a load error).
    `digests`: for released leases, the digest of each leased block taken when the lease was
    granted; the reader compares it with the digest of what it read. Added with a default: an
    owner that sends none is refused by readers that verify (the default).
    """

    released: list[str] = []
    pending: list[str] = []
    unknown: list[str] = []
    digests: dict[str, KVDigest] = {}


class Ack(_Message, tag="ack"):
    """Generic positive reply carrying how many items the receiver acted on."""

    count: int = 0


class Ping(_Message, tag="ping"):
    """Liveness probe; answered with `Pong`."""

    engine_id: str = ""


class Pong(_Message, tag="pong"):
    """Answer to `Ping`: who answers, so a client can address its next requests (auth.audience_of)."""

    engine_id: str
    protocol_version: int = PROTOCOL_VERSION
    incarnation: str = ""


class ErrorCode:
    """Values of `ErrorReply.code` (plain strings so old peers decode new codes)."""

    MALFORMED = "malformed"  # bytes that do not decode to a known message
    AUTH = "auth"  # unsigned, badly signed, stale or replayed frame
    INCOMPATIBLE = "incompatible"  # protocol version or compat hash mismatch
    HANDSHAKE = "handshake"  # handshake refused for another reason
    UNSUPPORTED = "unsupported"  # a valid message this server does not handle
    INTERNAL = "internal"  # the handler failed; see the server's log


class ErrorReply(_Message, tag="error"):
    """Any request can be answered with this; the client raises the matching named error."""

    code: str
    message: str


class HandoffOffer(_Message, tag="handoff_offer"):
    """Prefill -> decode, on a hand-off at once (transfer/offers.py): the kv_transfer_params the prefill made
    when the request finished (what it returns to its client too), offered under the client's hand-off key.
    Proves nothing by arriving: the decode checks `params` as it checks a client's."""

    key: str
    params: dict[str, Any]
    sent_ns: int = 0  # the prefill's wall clock as it sent the offer (time.time_ns): the decode times the hand-off


Message = Union[
    HandoffOffer,
    HandshakeRequest,
    HandshakeResponse,
    LeaseRenew,
    LeaseRenewReply,
    TransferDone,
    TransferDoneReply,
    Ack,
    Ping,
    Pong,
    ErrorReply,
]


class Frame(msgspec.Struct, array_like=True, frozen=True):
    """The side channel's envelope around one encoded message (not itself a `Message`).

    `corr_id` pairs a reply with its request. `nonce`, `timestamp_ns`, `mac` and `audience` are
    empty/zero on unauthenticated channels; see `auth.FrameSigner`.
    """

    corr_id: int
    payload: bytes
    nonce: bytes = b""
    timestamp_ns: int = 0
    mac: bytes = b""
    # Who the frame is for, covered by the MAC: a request names the destination engine instance
    # ("engine_id/incarnation"), a reply the nonce of the request it answers. A captured frame is
    # thus refused by any other node, by a restarted one, and as the answer to another request.
    audience: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_frame_decoder = msgspec.msgpack.Decoder(Frame)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises MalformedMessageError on anything else."""
    return _decode(_decoder, data, "message")


def encode_lease(ref: LeaseRef) -> bytes:
    """The canonical bytes of one lease (for fingerprints; never sent on its own)."""
    return _encoder.encode(ref)


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> Frame:
    """Decode one side-channel frame; raises MalformedMessageError on anything else."""
    return _decode(_frame_decoder, data, "side-channel frame")


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Message | Frame:
    # Bytes from the network: whatever msgspec refuses is the peer's fault, reported as one error type.
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessageError(f"not a kvbridge {what} ({len(data)} bytes): {e}") from None


def negotiate_version(peer_version: int, peer_min_version: int) -> int:
    """The protocol version two peers speak, or IncompatiblePeerError when their ranges do not overlap."""
    agreed = min(PROTOCOL_VERSION, peer_version)
    if agreed < max(MIN_PROTOCOL_VERSION, peer_min_version):
        raise IncompatiblePeerError(
            f"peer speaks kvbridge protocol {peer_min_version}..{peer_version}, this node "
            f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}; upgrade the older node"
        )
    return agreed
