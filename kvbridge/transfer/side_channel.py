"""The side channel: a small request/reply protocol over ZMQ, one server per engine.

`SideChannelServer` binds a ROUTER socket and serves on a background thread: each request frame
is verified (`auth.FrameSigner`), decoded (`messages.decode`) and passed to `handler(msg)`, whose
returned message is sent back. Bad input never stops the server: a frame that does not decode,
fails authentication or makes the handler raise is answered with an `ErrorReply`; a frame larger
than `max_message_bytes` is dropped by ZMQ (ZMQ_MAXMSGSIZE), which disconnects that peer. Only a
request that passed verification gets a signed reply: the answer to one that did not is an
unsigned `ErrorReply` that says so and nothing else, so a peer without the secret never obtains a
frame signed with it (whose audience, the request's nonce, it would have chosen).
Queues are bounded by ZMQ high-water marks; replies to a peer whose queue is full are dropped.

`handler` runs on the server thread, one message at a time. It must be quick (no transfers, no
waiting) and safe against the owner's own thread; it should be idempotent, because clients
retry. Returning None sends `Ack()`.

`SideChannelClient` is the REQ-like end over a DEALER socket: `request(msg)` sends, waits up to
`timeout_s` per attempt, retries `retries` times on a fresh socket, and raises
`PeerUnreachableError` naming the address when nothing answered. Within an attempt, a request
that has no answer after `RESEND_AFTER_S` is sent again, freshly sealed, on a new connection
(then after twice that, and so on), and the first answer to any copy counts: a TCP connection
that lost packets to a partition retransmits on the kernel's doubling backoff and can sit for
many seconds after the link is back, longer than a lease lives (measured in
tests/serve/test_netns.py), while a new connection goes through at once. Handlers are idempotent,
so a copy answered twice changes nothing. An `ErrorReply` is raised as
the matching named error (see `raise_for_error`). A client may be shared between threads: a lock
serializes requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import zmq

from kvbridge.errors import (
    AuthenticationError,
    HandshakeError,
    IncompatiblePeerError,
    KVBridgeError,
    MalformedMessageError,
    PeerUnreachableError,
    PortInUseError,
    TransferError,
)
from kvbridge.transfer import messages as m
from kvbridge.transfer.auth import FrameKind, FrameSigner

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # a handshake is a few KiB; NIXL metadata grows with registrations
_QUEUE_HWM = 1000  # messages buffered per peer and direction
_POLL_MS = 50  # how often the server thread checks for close()
RESEND_AFTER_S = 1.0  # an unanswered request is sent again on a new connection after this, then doubling

Handler = Callable[[m.Message], "m.Message | None"]

_CODE_TO_ERROR: dict[str, type[KVBridgeError]] = {
    m.ErrorCode.MALFORMED: MalformedMessageError,
    m.ErrorCode.AUTH: AuthenticationError,
    m.ErrorCode.INCOMPATIBLE: IncompatiblePeerError,
    m.ErrorCode.HANDSHAKE: HandshakeError,
}


def error_reply_for(exc: BaseException) -> m.ErrorReply:
    """The ErrorReply a server sends for an exception raised while handling a request."""
    for cls, code in (
        (IncompatiblePeerError, m.ErrorCode.INCOMPATIBLE),
        (HandshakeError, m.ErrorCode.HANDSHAKE),
        (AuthenticationError, m.ErrorCode.AUTH),
        (MalformedMessageError, m.ErrorCode.MALFORMED),
    ):
        if isinstance(exc, cls):
            return m.ErrorReply(code=code, message=str(exc))
    return m.ErrorReply(code=m.ErrorCode.INTERNAL, message=f"{type(exc).__name__} in the peer's handler; see its log")


def raise_for_error(reply: m.ErrorReply, address: str) -> None:
    """Raise the named error matching `reply.code` (TransferError for codes this build does not know)."""
    cls = _CODE_TO_ERROR.get(reply.code, TransferError)
    raise cls(f"peer {address} refused the request ({reply.code}): {reply.message}")


class _RateLimitedLog:
    """Log the first few events of a kind, then one in `every`, so a flood cannot flood the log."""

    def __init__(self, first: int = 5, every: int = 1000) -> None:
        self.count = 0
        self._first, self._every = first, every

    def warning(self, fmt: str, *args) -> None:
        self.count += 1
        if self.count <= self._first or self.count % self._every == 0:
            logger.warning(fmt + " (%d so far)", *args, self.count)


class SideChannelServer:
    """ROUTER socket + background thread answering requests with `handler`. Owned by one engine."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        handler: Handler | None = None,
        secret: bytes | None = None,
        *,
        address: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        audience: bytes = b"",
    ) -> None:
        """Bind `tcp://host:port` (port 0: a free port) or `address` (e.g. "ipc:///tmp/x") and start serving.

        `audience` (auth.audience_of) is this server's engine instance: with a secret, signed requests
        must name it, except pings, which may name nobody (b"") and are answered with who answers.
        """
        if handler is None:
            raise TypeError("SideChannelServer needs a handler(msg) -> reply")
        self._handler = handler
        self._signer = FrameSigner(secret)
        self._audience = audience
        self._bad_input = _RateLimitedLog()
        self._auth_failures = _RateLimitedLog()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.RCVHWM, _QUEUE_HWM)
        self._socket.setsockopt(zmq.SNDHWM, _QUEUE_HWM)
        try:
            self._socket.bind(address or f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._socket.close(0)
            where = f"the address {address}" if address else f"KVTransferConfig.side_channel_port={port} on {host}"
            raise PortInUseError(
                f"side channel cannot bind {where}: {e}; pick a free port, or 0 to let the system pick one"
            ) from None
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_requests = 0
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"kvbridge-side-channel {self.address}", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound TCP port (0 for ipc:// addresses)."""
        tail = self.address.rsplit(":", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    @property
    def num_rejected(self) -> int:
        """Frames answered with an error or dropped because they were malformed or unauthenticated."""
        return self._bad_input.count + self._auth_failures.count

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        sock = self._socket
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                while not self._stop.is_set():
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve_one(parts)
        except Exception:  # the thread must not die silently; the socket is unusable past this point
            logger.exception("side channel %s stopped on an unexpected error", self.address)
        finally:
            sock.close(0)

    def _serve_one(self, parts: list[bytes]) -> None:
        ident, body = parts[0], parts[1:]
        corr_id, frame, is_verified = 0, None, False
        try:
            if len(body) != 1:
                raise MalformedMessageError(f"expected one frame per request, got {len(body)}")
            frame = m.decode_frame(body[0])
            corr_id = frame.corr_id
            # The MAC first: with a secret, no byte of an unauthenticated payload reaches the decoder.
            self._signer.verify(FrameKind.REQUEST, frame, (self._audience, b""))
            msg = m.decode(frame.payload)
            # Only a ping, which says who answers, may name nobody: every other request is bound to
            # this very engine instance, handshakes included (their answers hold NIXL metadata).
            if self._signer.is_enabled and frame.audience != self._audience and not isinstance(msg, m.Ping):
                raise AuthenticationError(
                    "side-channel message addressed to another node, or to an earlier instance of this one, refused"
                )
            is_verified = True  # from here on the request is authentic: its answer is signed, errors included
            reply = self._handler(msg) or m.Ack()
            self.num_requests += 1
        except AuthenticationError as e:
            self._auth_failures.warning("side channel %s: %s", self.address, e)
            reply = error_reply_for(e)
        except MalformedMessageError as e:
            self._bad_input.warning("side channel %s: malformed input: %s", self.address, e)
            reply = error_reply_for(e)
        except Exception as e:  # handler bug or refusal: answer and keep serving
            if not isinstance(e, KVBridgeError):
                logger.exception("side channel %s: handler failed", self.address)
            reply = error_reply_for(e)
        if is_verified:
            sealed = self._signer.seal(FrameKind.REPLY, corr_id, m.encode(reply), audience=frame.nonce)
        else:  # never sign for a sender we could not verify: it chose the nonce (the audience) and the timing
            sealed = m.Frame(corr_id, m.encode(reply))
        self._send(ident, sealed)

    def _send(self, ident: bytes, frame: m.Frame) -> None:
        data = m.encode_frame(frame)
        try:
            self._socket.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone or its queue full: it will time out and retry
            pass


class SideChannelClient:
    """Talks to one peer's SideChannelServer. Thread-safe (requests are serialized by a lock)."""

    def __init__(
        self,
        address: str,
        secret: bytes | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self._max_message_bytes = max_message_bytes
        self._signer = FrameSigner(secret)
        self._corr_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None

    def request(self, msg: m.Message, timeout_s: float | None = None, audience: bytes = b"") -> m.Message:
        """Send `msg` and return the peer's reply (never an ErrorReply: that is raised).

        `audience` names the engine instance the request is for (auth.audience_of); a signed
        request that changes state must name it.

        Raises PeerUnreachableError after `retries + 1` attempts of `timeout_s` each,
        AuthenticationError when either side refuses the other's signature, and the error named
        by the peer's ErrorReply otherwise.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        payload = m.encode(msg)
        if len(payload) + 128 > self._max_message_bytes:
            raise MalformedMessageError(
                f"{type(msg).__name__} of {len(payload)} bytes exceeds the side channel's "
                f"{self._max_message_bytes}-byte limit"
            )
        with self._lock:
            for _ in range(self.retries + 1):
                reply = self._attempt(payload, timeout_s, audience)
                if reply is not None:
                    if isinstance(reply, m.ErrorReply):
                        raise_for_error(reply, self.address)
                    return reply
                self._reset_socket()  # a stale reply must not answer the next attempt
        raise PeerUnreachableError(
            f"no reply from side channel {self.address} within {timeout_s:.1f}s after "
            f"{self.retries + 1} attempts; check that the peer runs and the address is right"
        )

    def close(self) -> None:
        """Close the socket. Idempotent; a later request opens a new one."""
        with self._lock:
            self._reset_socket()

    def _attempt(self, payload: bytes, timeout_s: float, audience: bytes) -> m.Message | None:
        """Send `payload` and wait up to `timeout_s` for an answer, resending on new connections
        while none comes. The socket that answered is kept for the next request."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        nonces: dict[int, bytes] = {}  # corr id of each copy sent -> its nonce
        resend_after = RESEND_AFTER_S
        sock = self._ensure_socket()
        try:
            while True:
                self._send_copy(sock, payload, audience, nonces)
                poller.register(sock, zmq.POLLIN)
                resend_at = min(deadline, time.monotonic() + resend_after)
                while (left_ms := int((resend_at - time.monotonic()) * 1000)) > 0:
                    for ready, _ in poller.poll(left_ms):
                        reply = self._receive(ready, nonces)
                        if reply is not None:
                            self._socket = ready
                            return reply
                if resend_at >= deadline:
                    return None
                sock, resend_after = self._new_socket(), resend_after * 2
        finally:
            for registered in list(poller.sockets):
                if registered[0] is not self._socket:
                    registered[0].close(0)

    def _send_copy(self, sock: zmq.Socket, payload: bytes, audience: bytes, nonces: dict[int, bytes]) -> None:
        corr_id = next(self._corr_ids)
        sent = self._signer.seal(FrameKind.REQUEST, corr_id, payload, audience)
        nonces[corr_id] = sent.nonce
        sock.send(m.encode_frame(sent))

    def _receive(self, sock: zmq.Socket, nonces: dict[int, bytes]) -> m.Message | None:
        """The reply waiting on `sock` when it answers a copy of this request; None for a late reply
        to an earlier request. Raises AuthenticationError for a reply not signed for the copy it answers."""
        frame = m.decode_frame(sock.recv())
        nonce = nonces.get(frame.corr_id)
        if nonce is None:
            return None
        try:  # before decoding: with a secret, an unsigned reply (an ErrorReply too) is never believed
            self._signer.verify(FrameKind.REPLY, frame, (nonce,))  # a reply to this very copy
        except AuthenticationError as e:
            raise AuthenticationError(
                f"reply from {self.address} refused: {e} (a peer without our secret cannot sign its answers; a peer "
                "answers unsigned when it refused our request: signed with another secret, addressed to another node "
                "or an earlier instance of it, replayed, or outside the replay window)"
            ) from None
        return m.decode(frame.payload)

    def _ensure_socket(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = self._new_socket()
        return self._socket

    def _new_socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, _QUEUE_HWM)
        sock.setsockopt(zmq.RCVHWM, _QUEUE_HWM)
        sock.connect(self.address)
        return sock

    def _reset_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
