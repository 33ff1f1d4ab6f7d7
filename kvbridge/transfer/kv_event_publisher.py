"""vLLM's ZMQ KV-event publisher, on the wire as vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py).

    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                                                 replay_endpoint="tcp://*:5558"))
    publisher.publish(KVEventBatch(ts=time.time(), events=[...]))     # engine thread: never blocks
    publisher.shutdown()

Wire: each batch is one PUB message of three frames, (topic, 8-byte big-endian sequence number from 0,
msgpack `KVEventBatch`). A subscriber that missed some asks the ROUTER replay socket with one frame
(after its REQ/DEALER empty delimiter) holding the first sequence number it wants, 8 bytes big-endian;
it gets (empty, topic, seq, payload) for every buffered batch from there on (the last `buffer_steps`),
then (empty, b"", seq -1, b"") as the end marker.

The engine thread only puts the batch on a bounded queue and rings a pipe; encoding and sending run
on the publisher thread, which sleeps in one poll on that pipe and the replay socket (no wake-ups while
idle). A full queue drops the batch and counts it (`num_dropped`) rather than slowing the step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque

import zmq

from kvbridge.config import KVEventsConfig
from kvbridge.errors import ConfigError, PortInUseError
from kvbridge.repeated_log import RepeatedWarnings
from kvbridge.transfer.kv_event_messages import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 2.0  # how long shutdown waits for the thread to send what is queued


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + ROUTER replay socket + replay buffer, driven by one thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = self._attach(self._pub, config.endpoint, "endpoint")
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._attach(self._replay, config.replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closing = False
        self._warnings = RepeatedWarnings(logger)
        self.num_published = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvbridge-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint, config.topic)

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, what: str, bind: bool | None = None) -> str:
        try:
            if bind if bind is not None else is_bind_endpoint(endpoint):
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUseError(f"KV events {what} {endpoint} is in use; pick a free port") from exc
            raise ConfigError(f"KV events {what} {endpoint}: {exc}") from exc

    # ------------------------------------------------------------------ engine thread

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one step's batch for the publisher thread; never blocks."""
        if self._closing:
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            self._warnings.warning(
                "full", "KV events: %d batches wait for the publisher; dropping one (subscribers see a gap)",
                self.config.max_queue_size,
            )  # fmt: skip
            return
        self._ring()

    def _ring(self) -> None:
        try:
            os.write(self._wake_w, b"\x01")
        except BlockingIOError:  # the pipe is full of rings: the thread is awake anyway
            pass

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), stop the thread, close the sockets. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._ring()
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %s s", SHUTDOWN_TIMEOUT_S)
            return  # it still owns the sockets; the process is exiting
        self._close_sockets()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            self._send_queued()
            if self._replay is not None and self._replay in ready:
                self._serve_replays()
            if self._closing:
                self._send_queued()
                return

    def _send_queued(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                payload = encode_batch(batch)
                seq = self.num_published
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_published += 1
            except Exception:  # noqa: BLE001 - one bad batch must not stop publishing
                logger.exception("KV events: publishing a batch failed")

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: malformed replay request of %d frame(s) ignored", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
