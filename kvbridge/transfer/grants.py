"""Signed lease grants: the owner's word on a lease, carried in kv_transfer_params.

The owner of KV (a prefill engine) grants a request's lease when the request finishes there and
returns it, signed, with the params the client forwards to a reader (a decode engine):

    GrantSigner.sign(lease, incarnation, digest, lease_s) -> text in params["remote_grant"]
    open_grant(key, text) -> LeaseGrant (MAC checked) | GrantError

The key is random per owner process and reaches readers only in the handshake answer (over the side
channel, authenticated when a secret is set): a client that forwards the params can read the grant
but cannot make or alter one. A reader then needs no message between the landing of the bytes and
their use: it checks that the grant names its lease (the block ids and last block hash its own
prompt was matched against, the token) and the owner instance it handshook, that the term has not
run out, and that the blocks it read digest to the grant's values. The release travels afterwards.

Requests and replies of the side channel are MACed with the side-channel secret in a domain of their
own (transfer/auth.py); grants use another key and another domain, so neither can stand for the other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

import msgspec

from kvbridge.errors import KVBridgeError
from kvbridge.transfer import messages as m

_DOMAIN = b"kvbridge-lease-grant-v1\0"
MAC_NBYTES = 32  # HMAC-SHA256
KEY_NBYTES = 32
# A grant holds a digest per block (and per KV head when asked): a 128k-token prompt of 8 heads at
# 16 tokens per block is ~0.8 MB of base64. Anything much larger is refused before it is decoded.
MAX_GRANT_CHARS = 8 << 20
# A reader uses a grant only while at least this much of its term is left on its own clock: the
# owner's clock (wall time) may differ from the reader's by this much across hosts.
CLOCK_SKEW_S = 1.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(m.LeaseGrant)


class GrantError(KVBridgeError):
    """A grant in kv_transfer_params that cannot be used: malformed, not signed by the owner's key,
    for another lease or owner instance, or past its term. The reader confirms the read instead."""


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + body, hashlib.sha256).digest()


class GrantSigner:
    """The owner's key and the grants it signs. `wall_clock` is the owner's clock for `expires_at`."""

    def __init__(self, key: bytes | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        self.key = key if key is not None else secrets.token_bytes(KEY_NBYTES)
        if len(self.key) < KEY_NBYTES:
            raise ValueError(f"a grant key has at least {KEY_NBYTES} bytes")
        self._wall_clock = wall_clock

    def sign(self, lease: m.LeaseRef, incarnation: str, digest: m.KVDigest, lease_s: float) -> str:
        grant = m.LeaseGrant(lease=lease, incarnation=incarnation, expires_at=self._wall_clock() + lease_s, digest=digest)
        body = _encoder.encode(grant)
        return base64.urlsafe_b64encode(_mac(self.key, body) + body).decode("ascii")


def open_grant(key: bytes, text: str) -> m.LeaseGrant:
    """The grant that `text` carries, if the holder of `key` signed it. Raises GrantError."""
    if not key:
        raise GrantError("the owner's handshake gave no grant key (an older build)")
    if len(text) > MAX_GRANT_CHARS:
        raise GrantError(f"a grant of {len(text)} characters is larger than any lease needs")
    try:
        raw = base64.urlsafe_b64decode(text.encode("ascii"))
    except (ValueError, UnicodeError):
        raise GrantError("the grant is not base64") from None
    mac, body = raw[:MAC_NBYTES], raw[MAC_NBYTES:]
    if len(mac) != MAC_NBYTES or not hmac.compare_digest(mac, _mac(key, body)):
        raise GrantError("the grant is not signed by the owner's key")
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as e:  # signed but unreadable: an incompatible build
        raise GrantError(f"the grant cannot be decoded: {e}") from None


def check_grant(
    grant: m.LeaseGrant, lease: m.LeaseRef, incarnation: str, now_wall: float, skew_s: float = CLOCK_SKEW_S
) -> None:
    """That `grant` is the owner instance `incarnation`'s word on exactly `lease`, with time left. Raises GrantError."""
    if grant.lease != lease:
        raise GrantError("the grant names another lease than the params (blocks, block hash or token differ)")
    if grant.incarnation != incarnation:
        raise GrantError("the grant is from another instance of the prefill engine")
    if now_wall > grant.expires_at - skew_s:
        raise GrantError(f"the grant's term ended {now_wall - grant.expires_at:.3f} s ago (allowing {skew_s} s of clock skew)")
