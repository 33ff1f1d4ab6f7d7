"""A plain ZMQ subscriber of a node's KV events, as a router would run it (tests only).

    with KVEventSubscriber.bind() as sub:              # the node connects its PUB socket here
        node = start_node(..., extra_args=["--kv-events-config", sub.node_config(replay_port)])
        batches = sub.replay(replay_endpoint, 0)       # everything from seq 0, from the node's buffer
"""

from __future__ import annotations

import json
import threading

import zmq

from kvbridge.serve.launcher import HOST, free_ports
from kvbridge.transfer.kv_event_messages import KVEventBatch, decode_batch
from kvbridge.transfer.kv_event_publisher import END_SEQ

RECV_TIMEOUT_MS = 30_000


class KVEventSubscriber:
    """A SUB socket bound on loopback (nodes connect to it), read by a thread of its own as a router reads
    it (a SUB socket that nobody reads never sends its subscription to a publisher that connects to it),
    and replay requests over a DEALER."""

    def __init__(self, topic: str = "") -> None:
        self.topic = topic
        self._ctx = zmq.Context()
        self._messages: list[tuple[bytes, int, KVEventBatch]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        port = sub.bind_to_random_port(f"tcp://{HOST}")
        self.endpoint = f"tcp://{HOST}:{port}"
        self._thread = threading.Thread(target=self._read, args=(sub,), name="kv-event-sub", daemon=True)
        self._thread.start()  # the socket moves to the thread (start() is a full memory barrier)

    def _read(self, sub: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if sub.poll(50):
                    topic, seq, payload = sub.recv_multipart()
                    with self._lock:
                        self._messages.append((topic, int.from_bytes(seq, "big"), decode_batch(payload)))
        finally:
            sub.close(linger=0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    def node_config(self) -> tuple[str, str]:
        """(--kv-events-config JSON for a node that publishes here, the node's replay endpoint)."""
        replay = f"tcp://{HOST}:{free_ports(1)[0]}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                  "replay_endpoint": replay, "topic": self.topic, "buffer_steps": 1000, "hwm": 10000}  # fmt: skip
        return json.dumps(config), replay

    def received(self, quiet_s: float = 1.0) -> list[tuple[bytes, int, KVEventBatch]]:
        """(topic, seq, batch) of everything received so far, once `quiet_s` passed with nothing new."""
        while True:
            with self._lock:
                count = len(self._messages)
            self._stop.wait(quiet_s)
            with self._lock:
                if len(self._messages) == count:
                    return list(self._messages)

    def replay(self, replay_endpoint: str, start_seq: int) -> list[tuple[bytes, int, bytes]]:
        """(topic, seq, raw payload) of every buffered batch from `start_seq`, up to the end marker."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.connect(replay_endpoint)
        try:
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out = []
            while True:
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)
