"""Every message that crosses a process boundary in the transfer layer, as tagged msgspec Structs.

Wire format: msgpack. Each message is a `msgspec.Struct` tagged with a short string in the
`type` field; `encode` and `decode` are the only way in and out (one module-level encoder, one
typed decoder over the `Message` union), and receivers dispatch with `match`:

    match decode(data):
        case HandshakeRequest() as req: ...
        case TransferDone(req_ids=ids): ...

The side channel wraps every encoded message in a `Frame` (correlation id, nonce, timestamp and
an optional HMAC, see `auth.py`). NIXL notification payloads are bare encoded messages (a
`TransferDone`), never pickles.

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

from typing import Union

import msgspec

from kvbridge.errors import IncompatiblePeerError, MalformedMessageError

PROTOCOL_VERSION = 1  # what this build speaks
MIN_PROTOCOL_VERSION = 1  # the oldest version this build still understands


class _Message(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of every tagged message. Never encoded on its own."""


class KVRegion(msgspec.Struct, frozen=True, kw_only=True):
    """One registered KV memory region of an engine (its whole block-major KV tensor).

    Block `b` of the region lives at `base_addr + b * block_nbytes` (the handshake's block size).
    `mem_type` is NIXL's name: "DRAM" (host memory) or "VRAM" (GPU memory).
    """

    base_addr: int
    nbytes: int
    device_id: int = 0
    mem_type: str = "DRAM"


class IpcExport(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU KV tensor exported through CUDA IPC, for readers on the same host (transfer/cuda_ipc.py)."""

    host_id: str  # the kernel's boot id: the same host
    pid: int  # readers in this process use the tensor directly, not a mapping
    handle: bytes  # CUipcMemHandle of the allocation holding the KV tensor (64 bytes)
    offset: int  # KV tensor start inside that allocation
    nbytes: int
    device_uuid: str = ""  # the GPU holding it (ordinals differ between processes; UUIDs do not)


class HandshakeRequest(_Message, tag="hs_req"):
    """Reader -> owner of KV: "tell me how to read your blocks". Sent once per remote engine.

    `compat_hash` is `KVCacheLayout.compat_hash(model_id)`; a mismatch is refused with
    `ErrorReply(INCOMPATIBLE)`. The requester's own agent name/metadata are informative (logs,
    mapping NIXL notifications to engines); the server never loads them.
    """

    protocol_version: int
    engine_id: str
    compat_hash: str
    min_protocol_version: int = 1
    agent_name: str = ""
    agent_metadata: bytes = b""


class HandshakeResponse(_Message, tag="hs_resp"):
    """Owner of KV -> reader: everything needed to build NIXL descriptors locally.

    `protocol_version` is the version both sides speak from now on (the negotiated one).
    """

    protocol_version: int
    engine_id: str
    compat_hash: str
    agent_name: str
    agent_metadata: bytes  # nixl get_agent_metadata(); loaded with add_remote_agent
    regions: list[KVRegion]
    num_blocks: int
    block_nbytes: int
    # The KV tensor's CUDA IPC export when it is on a GPU and the owner offers it: readers on the
    # same host may map it instead of going through NIXL. Added with a default: old peers ignore it.
    cuda_ipc: IpcExport | None = None


class LeaseRenew(_Message, tag="lease"):
    """Reader -> owner: "I still intend to read these requests' blocks; keep them a while longer"."""

    engine_id: str
    req_ids: list[str]


class LeaseRenewReply(_Message, tag="lease_ok"):
    """Which of the renewed requests the owner still holds, and which it no longer knows."""

    held: list[str] = []
    unknown: list[str] = []


class TransferDone(_Message, tag="done"):
    """Reader -> owner: these requests' blocks were read (or abandoned); the owner may free them.

    Sent over the side channel, or as the NIXL notification payload of the last READ.
    Receivers must treat unknown request ids as already released (messages may be retried).
    """

    engine_id: str
    req_ids: list[str]
    failed_req_ids: list[str] = []


class TransferDoneReply(_Message, tag="done_ok"):
    """Owner -> reader, answering `TransferDone`: was each read covered by a live lease?

    `released`: the blocks were held until the reader said it was done, so the read was valid.
    `expired`: the lease had expired first; the blocks may have been reused during the read, which
    the reader must treat as a load error.
    """

    released: list[str] = []
    expired: list[str] = []


class Ack(_Message, tag="ack"):
    """Generic positive reply carrying how many items the receiver acted on."""

    count: int = 0


class Ping(_Message, tag="ping"):
    """Liveness probe; answered with `Pong`."""

    engine_id: str = ""


class Pong(_Message, tag="pong"):
    engine_id: str
    protocol_version: int = PROTOCOL_VERSION


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


Message = Union[
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

    `corr_id` pairs a reply with its request. `nonce`, `timestamp_ns` and `mac` are empty/zero on
    unauthenticated channels; see `auth.FrameSigner`.
    """

    corr_id: int
    payload: bytes
    nonce: bytes = b""
    timestamp_ns: int = 0
    mac: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_frame_decoder = msgspec.msgpack.Decoder(Frame)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises MalformedMessageError on anything else."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessageError(f"not a kvbridge message ({len(data)} bytes): {e}") from None


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> Frame:
    try:
        return _frame_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedMessageError(f"not a kvbridge side-channel frame ({len(data)} bytes): {e}") from None


def negotiate_version(peer_version: int, peer_min_version: int) -> int:
    """The protocol version two peers speak, or IncompatiblePeerError when their ranges do not overlap."""
    agreed = min(PROTOCOL_VERSION, peer_version)
    if agreed < max(MIN_PROTOCOL_VERSION, peer_min_version):
        raise IncompatiblePeerError(
            f"peer speaks kvbridge protocol {peer_min_version}..{peer_version}, this node "
            f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}; upgrade the older node"
        )
    return agreed
