"""The attacker's sockets: raw side-channel frames, a relay that captures them, and a TCP
listener that is not kvbridge.

The side channel is spoken in raw msgpack (the `Frame` envelope of kvbridge/transfer/messages.py:
`[corr_id, payload, nonce, timestamp_ns, mac, ...]`), never through kvbridge's own client, so an
old and a new build are sent the same bytes and an attacker needs nothing from kvbridge.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import msgspec
import zmq


def side_channel_address(params: dict[str, Any]) -> str:
    """The prefill's side channel that kv_transfer_params name."""
    return f"tcp://{params['remote_host']}:{params['remote_port']}"


def encode_frame(payload: bytes, corr_id: int = 1) -> bytes:
    """An unsigned side-channel frame: [corr_id, payload, nonce, timestamp_ns, mac] in msgpack."""
    return msgspec.msgpack.encode([corr_id, payload, b"", 0, b""])


def side_channel_send(address: str, frame: bytes, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """Send one raw frame to a node's side channel; its decoded reply message, or None (no reply)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = msgspec.msgpack.decode(sock.recv())
        return msgspec.msgpack.decode(reply[1])
    finally:
        sock.close(0)


def side_channel_message(address: str, message: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any] | None:
    """Send a message written as a plain dict (its tag in "type"), unsigned, as any client could."""
    return side_channel_send(address, encode_frame(msgspec.msgpack.encode(message)), timeout_s)


class FrameRelay:
    """A man in the middle on the side channel: forwards frames to `target` and keeps a copy of each.

    Point a decode node at `tcp://127.0.0.1:{relay.port}` (the `remote_port` of its params) and
    `captured` fills with the frames it sends, signed for the node behind the relay. `delay_replies`
    holds back the answers to requests of the given message types by that many seconds (a slow peer).
    """

    def __init__(self, target: str, delay_replies: dict[str, float] | None = None) -> None:
        self._delay_replies = delay_replies or {}
        self._last_type: dict[bytes, str] = {}  # downstream peer -> the type of its last request
        self._held: list[tuple[float, bytes, bytes]] = []  # (send at, ident, reply)
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._target = target
        self._backs: dict[bytes, zmq.Socket] = {}  # one upstream socket per downstream peer
        self.captured: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-frame-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            for held in [h for h in self._held if h[0] <= now]:
                self._held.remove(held)
                self._front.send_multipart([held[1], held[2]])
            for sock, _ in poller.poll(10 if self._held else 50):
                if sock is self._front:
                    ident, frame = self._front.recv_multipart()
                    self.captured.append(frame)
                    self._last_type[ident] = message_type(frame)
                    if ident not in self._backs:
                        back = self._backs[ident] = self._ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self._target)
                        poller.register(back, zmq.POLLIN)
                    self._backs[ident].send(frame)
                else:
                    ident = next(i for i, b in self._backs.items() if b is sock)
                    delay = self._delay_replies.get(self._last_type.get(ident, ""), 0.0)
                    if delay:
                        self._held.append((time.monotonic() + delay, ident, sock.recv()))
                    else:
                        self._front.send_multipart([ident, sock.recv()])
        for sock in [self._front, *self._backs.values()]:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()


def message_type(frame: bytes) -> str:
    """The tag of the message inside a captured frame."""
    return msgspec.msgpack.decode(msgspec.msgpack.decode(frame)[1])["type"]


class TcpListener:
    """A TCP listener that is not kvbridge: counts connections, answers each with `greeting`, holds it."""

    def __init__(self, host: str = "127.0.0.1", greeting: bytes = b"HTTP/1.1 400 Bad Request\r\n\r\n") -> None:
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.1)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.num_connections = 0
        self._greeting = greeting
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-tcp-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.num_connections += 1
            self._conns.append(conn)
            with contextlib.suppress(OSError):
                conn.sendall(self._greeting)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in [self._sock, *self._conns]:
            conn.close()
