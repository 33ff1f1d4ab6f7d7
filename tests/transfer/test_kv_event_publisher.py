"""The ZMQ KV-event publisher (transfer/kv_event_publisher.py) against plain ZMQ sockets: vLLM's frames,
sequence numbers from 0, replays from the ROUTER socket, bad replay requests, busy endpoints."""

from __future__ import annotations

import time

import pytest
import zmq

from kvbridge.config import KVEventsConfig
from kvbridge.errors import ConfigError, PortInUseError
from kvbridge.transfer.kv_event_messages import AllBlocksCleared, BlockRemoved, KVEventBatch, decode_batch
from kvbridge.transfer.kv_event_publisher import END_SEQ, ZmqEventPublisher

RECV_TIMEOUT_MS = 10_000


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _publish_until_seen(publisher: ZmqEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops what it sends before the subscription arrives: publish probes until one gets through."""
    sub.setsockopt(zmq.RCVTIMEO, 100)
    for _ in range(100):
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("the subscriber never received a probe")
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    while sub.poll(200):  # probes already on their way
        sub.recv_multipart()


def test_batches_go_out_as_topic_seq_payload_and_replay_from_any_seq(ctx, endpoints):
    pub_ep, replay_ep = endpoints
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv@n1")
    publisher = ZmqEventPublisher(config)
    try:
        sub = _subscribe(ctx, pub_ep, b"kv@n1")
        _publish_until_seen(publisher, sub)
        first = publisher.num_published
        for i in range(5):
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[i], medium="GPU")]))
        got = [sub.recv_multipart() for _ in range(5)]
        assert [frames[0] for frames in got] == [b"kv@n1"] * 5
        assert [int.from_bytes(frames[1], "big") for frames in got] == list(range(first, first + 5))
        batches = [decode_batch(frames[2]) for frames in got]
        assert [b.events[0].block_hashes for b in batches] == [[i] for i in range(5)]
        assert all(b.data_parallel_rank == 0 for b in batches)

        answers = []
        dealer = ctx.socket(zmq.DEALER)  # several replies to one request: read them as a DEALER does
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.connect(replay_ep)
        dealer.send_multipart((b"", (first + 3).to_bytes(8, "big")))
        while True:
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            answers.append(frames)
        assert [int.from_bytes(f[2], "big") for f in answers] == [first + 3, first + 4]
        assert [f[3] for f in answers] == [g[2] for g in got[3:]]  # the very bytes published
        dealer.close(linger=0)
    finally:
        publisher.shutdown()


def test_a_malformed_replay_request_is_ignored_and_replays_go_on(ctx, endpoints):
    pub_ep, replay_ep = endpoints
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, replay_endpoint=replay_ep))
    try:
        publisher.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.connect(replay_ep)
        dealer.send_multipart((b"", b"not eight bytes at all", b"extra"))
        dealer.send_multipart((b"", b"\x00" * 3))
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = dealer.recv_multipart()
        assert int.from_bytes(frames[2], "big") == 0 and decode_batch(frames[3]).events == [AllBlocksCleared()]
        assert dealer.recv_multipart()[2] == END_SEQ
        dealer.close(linger=0)
    finally:
        publisher.shutdown()


def test_a_busy_endpoint_is_a_named_error_and_a_bad_one_too(ctx):
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(PortInUseError, match=f"tcp://127.0.0.1:{port}"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:1",
                                             replay_endpoint=f"tcp://127.0.0.1:{port}"))  # fmt: skip
    finally:
        taken.close(linger=0)
    with pytest.raises(ConfigError, match="not a ZMQ address"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="localhost:5557")
    with pytest.raises(ConfigError, match="unknown key"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoints": "tcp://*:5557"}')
    with pytest.raises(ConfigError, match="buffer_steps"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "buffer_steps": -3}')


def test_shutdown_sends_what_is_queued_and_is_idempotent(ctx, endpoints):
    pub_ep, _ = endpoints
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep))
    sub = _subscribe(ctx, pub_ep)
    _publish_until_seen(publisher, sub)
    publisher.publish(KVEventBatch(ts=2.0, events=[BlockRemoved(block_hashes=[7], medium="GPU")]))
    publisher.shutdown()
    publisher.shutdown()
    assert decode_batch(sub.recv_multipart()[2]).events[0].block_hashes == [7]
    publisher.publish(KVEventBatch(ts=3.0, events=[]))  # after shutdown: dropped, no error


def test_a_burst_beyond_the_queue_is_dropped_and_counted_never_waited_for(ctx, endpoints):
    """The engine thread never waits on the publisher: a burst past `max_queue_size` is dropped and counted,
    and what was sent is numbered without gaps (a subscriber sees sequence numbers 0, 1, 2, ...)."""
    pub_ep, replay_ep = endpoints
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_ep, replay_endpoint=replay_ep, max_queue_size=2)
    publisher = ZmqEventPublisher(config)
    num = 5000
    for i in range(num):  # the publisher thread cannot keep up with this loop: it holds the GIL for 5 ms at a time
        publisher.publish(KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")]))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(replay_ep)
    time.sleep(0.2)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    seqs, hashes = [], []
    while (frames := dealer.recv_multipart())[2] != END_SEQ:
        seqs.append(int.from_bytes(frames[2], "big"))
        hashes.append(decode_batch(frames[3]).events[0].block_hashes[0])
    publisher.shutdown()
    assert publisher.num_published + publisher.num_dropped == num
    assert publisher.num_dropped > 0, "the burst never filled a queue of 2"
    assert seqs == list(range(len(seqs))) and hashes == sorted(hashes)  # in order, numbered without gaps
    dealer.close(linger=0)
