"""Hand-off at once: the prefill offers a finished prompt's kv_transfer_params straight to the decode.

In turn, a client sends the prompt to the prefill, waits for the params it returns, and only then
sends them to the decode: the decode leg starts when the prefill leg has come back. At once, the
client sends both legs together under a hand-off key it draws (kv_transfer_params.py):

    client -> prefill: {"do_remote_decode": true, "handoff": {"key": K, "inbox": <decode's inbox>}}
    client -> decode:  {"do_remote_prefill": true, "handoff_key": K}

The decode's scheduler leaves the request waiting until an offer for K is in its `OfferInbox`, a
ZMQ PULL socket it drains without blocking, on the engine thread, while it matches. The prefill's
scheduler sends the offer from `OfferOutbox` on its engine thread, in the `request_finished` that
makes the params: no Python thread, client round trip or poll of the prefill stands between the
prefill's last step and the decode's read.

An offer proves nothing by arriving. The decode checks the params in it as it checks a client's
(the prefill's address proof, allowed_peers, the prompt's block hash, the grant's digests), so an
inbox only saves the round trip. Frames are signed with the side-channel secret (auth.py, kind
OFFER, audience the decode instance), so without the secret nobody offers at all, and a replay is
refused. The decode's answers name its inbox, vouched for with the secret in a domain of its own
(address_proof.INBOX_DOMAIN): the prefill sends to no inbox without that proof, so an API client
cannot point the prefill at a port of its choosing. An inbox keeps at most `max_offers` offers, each
for at most `keep_s`; a frame over `MAX_OFFER_BYTES` is dropped by ZMQ. A decode request whose
offer never comes is computed locally after its wait (NixlConnector option handoff_wait_s).
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections import OrderedDict
from typing import Any, Callable

import zmq

from kvbridge.errors import AuthenticationError, MalformedMessageError, PortInUseError
from kvbridge.kv_transfer_params import HandoffRequest, InboxAddress
from kvbridge.transfer import messages as m
from kvbridge.transfer.address_proof import CLOCK_SKEW_S, INBOX_DOMAIN, SideChannelAddress, prove_address
from kvbridge.transfer.auth import FrameKind, FrameSigner, audience_of

logger = logging.getLogger(__name__)

MAX_OFFER_BYTES = 2 << 20  # the params of a 1M-token prompt in 16-token blocks are ~0.6 MB
INBOX_TERM_S = 600.0  # how long a decode's answer vouches for its inbox (a proxy refreshes it from each answer)
_QUEUE_HWM = 1000  # frames queued in ZMQ per inbox, and per outbox socket
_MAX_OUTBOX_SOCKETS = 64  # decode inboxes a prefill keeps a connection to, least recently used dropped


def _proof_address(inbox: InboxAddress) -> SideChannelAddress:
    return SideChannelAddress(inbox.engine_id, inbox.incarnation, inbox.host, inbox.port)


def check_inbox(secret: bytes | None, inbox: InboxAddress, now_wall: float) -> None:
    """Raise AuthenticationError unless `inbox` is vouched for with `secret` and its term has not ended
    (nothing to check without a secret)."""
    if secret is None:
        return
    if not inbox.mac:
        raise AuthenticationError(
            "the hand-off names a decode inbox without its proof (inbox.mac): pass the handoff_inbox that the "
            "decode node answered, unchanged"
        )
    expected = prove_address(secret, _proof_address(inbox), inbox.expires_at, INBOX_DOMAIN)
    if not hmac.compare_digest(inbox.mac.encode("ascii", "replace"), expected.encode()):
        raise AuthenticationError(
            f"the decode inbox {inbox.host}:{inbox.port} is not vouched for with this node's side-channel secret "
            "(altered, or the decode node uses another secret); nothing was sent"
        )
    if now_wall > inbox.expires_at + CLOCK_SKEW_S:
        raise AuthenticationError(
            f"the proof of the decode inbox {inbox.host}:{inbox.port} ended {now_wall - inbox.expires_at:.0f} s "
            "ago: take handoff_inbox from a recent decode answer; nothing was sent"
        )


class OfferInbox:
    """Decode: the bound PULL socket offers arrive on, and the offers not yet taken. Engine thread only."""

    def __init__(
        self,
        host: str,
        port: int,
        engine_id: str,
        incarnation: str,
        secret: bytes | None,
        *,
        keep_s: float = 60.0,
        max_offers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine_id, self._incarnation, self._host = engine_id, incarnation, host
        self._secret = secret
        self._signer = FrameSigner(secret)
        self._audience = audience_of(engine_id, incarnation)
        self._keep_s, self._max_offers = keep_s, max_offers
        self._clock, self._wall_clock = clock, wall_clock
        self._offers: OrderedDict[str, tuple[float, m.HandoffOffer]] = OrderedDict()  # key -> (arrived, offer)
        self.num_offers = 0  # accepted
        self.num_rejected = 0  # unsigned, badly signed, replayed, for another instance, malformed
        self.num_expired = 0  # kept past keep_s or evicted unclaimed
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_OFFER_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _QUEUE_HWM)
        try:
            self._socket.bind(f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}")
        except zmq.ZMQError as e:
            self._socket.close(0)
            raise PortInUseError(
                f"the hand-off inbox cannot bind port {port} on {host}: {e}; set NixlConnector option "
                "handoff_inbox_port to a free port, or 0 to let the system pick one"
            ) from None
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[-1])

    def address(self) -> InboxAddress:
        """This inbox, vouched for (with a secret) for INBOX_TERM_S from now."""
        if self._secret is None:
            return InboxAddress(engine_id=self._engine_id, incarnation=self._incarnation, host=self._host, port=self.port)
        expires_at = float(math.ceil(self._wall_clock() + INBOX_TERM_S))  # whole seconds cross any JSON proxy
        address = SideChannelAddress(self._engine_id, self._incarnation, self._host, self.port)
        mac = prove_address(self._secret, address, expires_at, INBOX_DOMAIN)
        return InboxAddress(
            engine_id=self._engine_id, incarnation=self._incarnation, host=self._host, port=self.port, mac=mac,
            expires_at=expires_at,
        )  # fmt: skip

    def is_mine(self, inbox: InboxAddress) -> bool:
        """Whether `inbox` names this engine instance's inbox (a restarted engine has another incarnation)."""
        return inbox.engine_id == self._engine_id and inbox.incarnation == self._incarnation

    def take(self, key: str) -> m.HandoffOffer | None:
        """The offer under `key` (once), after draining what arrived; None when none came yet."""
        self._drain()
        entry = self._offers.pop(key, None)
        return None if entry is None else entry[1]

    def wait_for(self, key: str, timeout_s: float) -> m.HandoffOffer | None:
        """`take(key)`, waiting up to `timeout_s` for the offer to arrive; whatever else arrives meanwhile
        is kept for its own request. Wakes as a frame lands, not at the next poll."""
        deadline = time.monotonic() + timeout_s
        while True:
            offer = self.take(key)
            remaining = deadline - time.monotonic()
            if offer is not None or remaining <= 0:
                return offer
            self._socket.poll(max(1, math.ceil(remaining * 1e3)), zmq.POLLIN)  # whole ms: zmq_poll's unit

    def _drain(self, max_frames: int = 1024) -> None:
        for _ in range(max_frames):
            try:
                data = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept(data)
        now = self._clock()
        while self._offers and (len(self._offers) > self._max_offers or next(iter(self._offers.values()))[0] + self._keep_s < now):
            self._offers.popitem(last=False)
            self.num_expired += 1

    def _accept(self, data: bytes) -> None:
        try:
            frame = m.decode_frame(data)
            self._signer.verify(FrameKind.OFFER, frame, (self._audience,))  # the MAC before any payload byte
            offer = m.decode(frame.payload)
            if not isinstance(offer, m.HandoffOffer):
                raise MalformedMessageError(f"a {type(offer).__name__} is not a hand-off offer")
        except (AuthenticationError, MalformedMessageError) as e:
            self.num_rejected += 1
            if self.num_rejected <= 5 or self.num_rejected % 1000 == 0:
                logger.warning("hand-off inbox: frame refused (%d so far): %s", self.num_rejected, e)
            return
        if offer.key not in self._offers:  # the first offer under a key stands
            self._offers[offer.key] = (self._clock(), offer)
            self.num_offers += 1

    def close(self) -> None:
        self._socket.close(0)
        self._offers.clear()


class OfferOutbox:
    """Prefill: sends offers to decode inboxes, one PUSH connection per inbox. Engine thread only."""

    def __init__(self, secret: bytes | None, wall_clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._signer = FrameSigner(secret)
        self._wall_clock = wall_clock
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()  # inbox address -> PUSH, most recent last
        self.num_sent = 0
        self.num_dropped = 0  # the inbox's queue was full (a decode gone or stuck): it computes after its wait

    def offer(self, handoff: HandoffRequest, params: dict[str, Any]) -> None:
        """Send `params` to the inbox `handoff` names, without blocking. Raises AuthenticationError when the
        inbox is not vouched for (nothing is sent)."""
        check_inbox(self._secret, handoff.inbox, self._wall_clock())
        inbox = handoff.inbox
        payload = m.encode(m.HandoffOffer(key=handoff.key, params=params, sent_ns=time.time_ns()))
        frame = self._signer.seal(FrameKind.OFFER, 0, payload, audience=audience_of(inbox.engine_id, inbox.incarnation))
        try:
            self._socket_for(inbox.address).send(m.encode_frame(frame), zmq.NOBLOCK)
            self.num_sent += 1
        except zmq.Again:
            self.num_dropped += 1
            logger.warning("hand-off offer to %s dropped: its queue is full (the decode node is gone or stuck)", inbox.address)

    def _socket_for(self, address: str) -> zmq.Socket:
        sock = self._sockets.pop(address, None)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _QUEUE_HWM)
            sock.connect(address)
            if len(self._sockets) >= _MAX_OUTBOX_SOCKETS:
                _, oldest = self._sockets.popitem(last=False)
                oldest.close(0)
        self._sockets[address] = sock
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
