"""Shared-secret authentication of side-channel frames: HMAC-SHA256 with a nonce and a timestamp.

Both ends of a side channel own a `FrameSigner`. `seal` wraps an encoded message in a `Frame`,
signed when a secret is configured; `verify` checks a received frame and raises
`AuthenticationError` when it is unsigned, badly signed, outside the time window, or replayed
(its nonce was already seen inside the window).

The MAC covers: a domain string (one for requests, another for replies, so that no signed reply is
ever a valid request, nor a request a valid reply), the correlation id, the timestamp, the nonce, the audience and
the payload. The audience names who the frame is for: a request carries its destination engine
instance ("engine_id/incarnation", see `audience_of`), a reply the nonce of its request; `verify`
refuses a frame whose audience is not the one expected, so a captured frame cannot be replayed to
another node, to a restarted node, or as the answer to another request.
Only frames with a valid MAC enter the replay cache, so forged traffic cannot grow it; its size
is capped anyway, and evicting an entry raises a floor below which every timestamp is refused,
so a capped cache never re-opens a replay.

A signer without a secret seals unsigned frames and accepts any frame (no authentication).
A secret shorter than `MIN_SECRET_NBYTES` is refused (`check_secret`). Error messages never contain
the secret or a MAC.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import struct
import time
from collections import OrderedDict
from typing import Callable

from kvbridge.errors import AuthenticationError, ConfigError
from kvbridge.transfer.messages import Frame

logger = logging.getLogger(__name__)

NONCE_NBYTES = 16
MIN_SECRET_NBYTES = 32  # 256 bits: HMAC-SHA256's key strength; a shorter secret is guessable offline
_HINT = "set the same KVBRIDGE_SIDE_CHANNEL_SECRET on both nodes"


class FrameKind(enum.Enum):
    """Which way a frame goes; each has its own MAC domain."""

    REQUEST = b"kvbridge-side-channel-v3/request"
    REPLY = b"kvbridge-side-channel-v3/reply"
    OFFER = b"kvbridge-side-channel-v3/offer"  # a prefill's hand-off offer to a decode's inbox (transfer/offers.py)


def check_secret(secret: bytes | None, source: str = "the side-channel secret") -> None:
    """ConfigError naming `source` when `secret` is set but shorter than MIN_SECRET_NBYTES."""
    if secret is not None and len(secret) < MIN_SECRET_NBYTES:
        raise ConfigError(
            f"{source} is {len(secret)} bytes long; a side-channel secret must have at least {MIN_SECRET_NBYTES} "
            "(e.g. the output of `openssl rand -hex 32`)"
        )


class FrameSigner:
    """Signs outgoing frames and verifies incoming ones. Not thread-safe; one per socket owner."""

    def __init__(
        self,
        secret: bytes | None,
        *,
        window_s: float = 30.0,
        max_nonces: int = 100_000,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        check_secret(secret or None)
        self._secret = secret or None
        self._window_ns = int(window_s * 1e9)
        self._max_nonces = max_nonces
        self._clock_ns = clock_ns
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> timestamp_ns, oldest first
        self._floor_ns = 0  # timestamps <= floor are refused (set by evictions)

    @property
    def is_enabled(self) -> bool:
        return self._secret is not None

    def seal(self, kind: FrameKind, corr_id: int, payload: bytes, audience: bytes = b"") -> Frame:
        if self._secret is None:
            return Frame(corr_id, payload)
        nonce = os.urandom(NONCE_NBYTES)
        ts = self._clock_ns()
        return Frame(corr_id, payload, nonce, ts, self._mac(kind, corr_id, ts, nonce, audience, payload), audience)

    def verify(self, kind: FrameKind, frame: Frame, audiences: tuple[bytes, ...] = (b"",)) -> None:
        """Raise AuthenticationError unless `frame` is a `kind` frame, acceptable and for one of `audiences`;
        remember its nonce."""
        if self._secret is None:
            return
        if not frame.mac:
            raise AuthenticationError(f"unsigned side-channel message refused; {_HINT}")
        if len(frame.nonce) != NONCE_NBYTES:
            raise AuthenticationError(f"side-channel message with a malformed nonce refused; {_HINT}")
        expected = self._mac(kind, frame.corr_id, frame.timestamp_ns, frame.nonce, frame.audience, frame.payload)
        if not hmac.compare_digest(expected, frame.mac):
            raise AuthenticationError(f"side-channel message with a wrong signature refused; {_HINT}")
        if frame.audience not in audiences:
            raise AuthenticationError(
                "side-channel message addressed to another node, or to an earlier instance of this one, refused"
            )
        now = self._clock_ns()
        if abs(now - frame.timestamp_ns) > self._window_ns or frame.timestamp_ns <= self._floor_ns:
            raise AuthenticationError(
                f"side-channel message outside the {self._window_ns / 1e9:.0f}s replay window refused; "
                "check that both nodes' clocks are synchronized"
            )
        self._prune(now)
        if frame.nonce in self._seen:
            raise AuthenticationError("replayed side-channel message refused (nonce already seen)")
        self._seen[frame.nonce] = frame.timestamp_ns
        while len(self._seen) > self._max_nonces:
            _, ts = self._seen.popitem(last=False)
            self._floor_ns = max(self._floor_ns, ts)

    def _prune(self, now_ns: int) -> None:
        oldest_kept = now_ns - self._window_ns
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= oldest_kept:
                break
            del self._seen[nonce]

    def _mac(
        self, kind: FrameKind, corr_id: int, timestamp_ns: int, nonce: bytes, audience: bytes, payload: bytes
    ) -> bytes:
        assert self._secret is not None
        header = struct.pack(
            ">QQI", corr_id & 0xFFFF_FFFF_FFFF_FFFF, timestamp_ns & 0xFFFF_FFFF_FFFF_FFFF, len(audience) & 0xFFFF_FFFF
        )  # the audience's length keeps (audience, payload) boundaries unambiguous
        return hmac.new(self._secret, kind.value + header + nonce + audience + payload, hashlib.sha256).digest()


def audience_of(engine_id: str, incarnation: str) -> bytes:
    """The audience of a request for one engine instance."""
    return f"{engine_id}/{incarnation}".encode()


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP literal or "localhost") can only be reached from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, secret: bytes | None, insecure: bool) -> None:
    """Refuse to serve a side channel off loopback without a secret, unless `insecure` says so; warn
    whenever one is served without a secret.

    Whoever reaches an unauthenticated side channel can handshake, and a handshake hands out the NIXL
    metadata (and CUDA IPC handle) of the whole KV region, which lets its holder write into it. On
    loopback that is every process of the host, any user's. A node resolves its secret with
    `host_secret.side_channel_secret`, so it has none only with `insecure` (or a caller that passed
    `secret=None` to an endpoint of its own, as in-process tests do).
    """
    if secret is not None:
        return
    if not insecure and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve the KV side channel on {host} without a secret: anyone who reaches it could "
            "write into this node's KV cache. Set the same KVBRIDGE_SIDE_CHANNEL_SECRET on every node, or pass "
            "--insecure-side-channel (NixlConnector option insecure_side_channel) on a network you trust entirely"
        )
    if insecure:
        logger.warning(
            "the KV side channel on %s has no secret (--insecure-side-channel): any process that reaches it%s can "
            "read this node's KV cache and write into it; unset the flag (one user's nodes on one host share a "
            "secret by default) or set KVBRIDGE_SIDE_CHANNEL_SECRET on every node", host,
            ", of any user of this host," if is_loopback(host) else "",
        )  # fmt: skip
