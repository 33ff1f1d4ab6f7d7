"""Side channel: request/reply, error mapping, timeouts, fuzzing, oversized input, authentication, replay."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import msgspec
import pytest
import zmq

from kvbridge.errors import (
    AuthenticationError,
    IncompatiblePeerError,
    MalformedMessageError,
    PeerUnreachableError,
    TransferError,
)
from kvbridge.transfer import messages as m
from kvbridge.transfer.auth import FrameKind, FrameSigner, audience_of
from kvbridge.transfer.side_channel import SideChannelClient, SideChannelServer

SECRET = b"s3cret-for-tests-of-the-side-channel"
AUDIENCE = audience_of("prefill-0", "inc-1")
REQ = FrameKind.REQUEST


def _done(*req_ids: str) -> m.TransferDone:
    leases = [m.LeaseRef(req_id=r, token="t", block_ids=[1], block_hash="h") for r in req_ids]
    return m.TransferDone(engine_id="d", incarnation="inc-1", leases=leases)


def _handler(msg: m.Message) -> m.Message | None:
    match msg:
        case m.Ping(engine_id="boom"):
            raise RuntimeError("handler bug")
        case m.Ping(engine_id="incompatible"):
            raise IncompatiblePeerError("different model")
        case m.Ping(engine_id=eid) if eid.startswith("sleep"):
            time.sleep(float(eid[5:]))
            return m.Pong(engine_id=eid)
        case m.Ping(engine_id=eid):
            return m.Pong(engine_id=eid)
        case m.TransferDone(leases=leases):
            return m.Ack(count=len(leases))
        case _:
            return None


@pytest.fixture
def server():
    srv = SideChannelServer("127.0.0.1", 0, _handler)
    yield srv
    srv.close()


@pytest.fixture
def secure_server():
    srv = SideChannelServer("127.0.0.1", 0, _handler, SECRET)
    yield srv
    srv.close()


def _client(address, secret=None, timeout_s=2.0, retries=0):
    return SideChannelClient(address, secret, timeout_s, retries)


def test_round_trip_on_a_free_port(server):
    assert server.port > 0 and server.address == f"tcp://127.0.0.1:{server.port}"
    client = _client(server.address)
    try:
        assert client.request(m.Ping(engine_id="d")) == m.Pong(engine_id="d")
        assert client.request(_done("a", "b")) == m.Ack(count=2)
        assert client.request(m.LeaseRenew(engine_id="d", incarnation="i", leases=[])) == m.Ack()  # None -> Ack
    finally:
        client.close()


def test_ipc_address(tmp_path):
    srv = SideChannelServer(handler=_handler, address=f"ipc://{tmp_path}/sc.sock")
    client = _client(srv.address)
    try:
        assert srv.port == 0
        assert client.request(m.Ping(engine_id="x")) == m.Pong(engine_id="x")
    finally:
        client.close()
        srv.close()


def test_handler_errors_become_named_errors_and_server_keeps_serving(server):
    client = _client(server.address)
    try:
        with pytest.raises(TransferError, match="internal") as info:
            client.request(m.Ping(engine_id="boom"))
        assert type(info.value) is TransferError
        with pytest.raises(IncompatiblePeerError, match="different model"):
            client.request(m.Ping(engine_id="incompatible"))
        assert client.request(m.Ping(engine_id="ok")) == m.Pong(engine_id="ok")
    finally:
        client.close()


def test_unreachable_peer_raises_with_address_within_deadline():
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # find a free port, then leave it closed
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    client = _client(address, timeout_s=0.2, retries=2)
    start = time.monotonic()
    with pytest.raises(PeerUnreachableError, match=address):
        client.request(m.Ping())
    assert time.monotonic() - start < 10.0  # 3 tries of 0.2 s: bounded, not a hang (generous for a loaded machine)
    client.close()


def test_late_reply_to_a_timed_out_attempt_is_not_mistaken_for_the_next(server):
    client = _client(server.address, timeout_s=0.3, retries=1)
    try:
        with pytest.raises(PeerUnreachableError):
            client.request(m.Ping(engine_id="sleep0.5"))  # both attempts time out
        assert client.request(m.Ping(engine_id="next")) == m.Pong(engine_id="next")
    finally:
        client.close()


def test_a_request_stuck_on_a_dead_connection_is_sent_again_on_a_new_one():
    """A connection that swallows the request (as one backing off after a partition does): the copy
    sent on a new connection after RESEND_AFTER_S is answered long before the attempt's timeout,
    and the connection that answered serves the next request."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[bytes] = []  # the connection (ROUTER identity) each request arrived on

    def serve() -> None:
        while len(seen) < 3 and router.poll(20_000):
            ident, data = router.recv_multipart()
            seen.append(ident)
            if len(seen) == 1:
                continue  # the first connection is dead: its request never gets an answer
            request = m.decode_frame(data)
            router.send_multipart([ident, m.encode_frame(m.Frame(request.corr_id, m.encode(m.Ack(count=len(seen)))))])

    thread = threading.Thread(target=serve)
    thread.start()
    client = _client(f"tcp://127.0.0.1:{port}", timeout_s=60.0)
    try:
        start = time.monotonic()
        assert client.request(m.Ping(engine_id="me")) == m.Ack(count=2)
        assert time.monotonic() - start < 30.0  # answered by the resent copy, not after the 60 s attempt
        assert client.request(m.Ping(engine_id="me")) == m.Ack(count=3)
    finally:
        thread.join(30)
        client.close()
        router.close(0)
    assert len(seen) == 3 and seen[0] != seen[1] == seen[2]


def test_client_is_thread_safe(server):
    client = _client(server.address)
    errors = []

    def worker(i):
        for j in range(20):
            eid = f"t{i}-{j}"
            if client.request(m.Ping(engine_id=eid)) != m.Pong(engine_id=eid):
                errors.append(eid)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    client.close()
    assert not errors


def test_close_is_idempotent_and_joins_the_thread():
    srv = SideChannelServer("127.0.0.1", 0, _handler)
    srv.close()
    srv.close()
    assert not srv._thread.is_alive()


def _raw_dealer(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _fuzz_payloads(rng: random.Random, n: int) -> list[list[bytes]]:
    valid_frame = m.encode_frame(m.Frame(1, m.encode(m.Ping(engine_id="fuzz"))))
    valid_msg = m.encode(m.HandshakeRequest(protocol_version=1, engine_id="e", compat_hash="h"))
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            parts = [rng.randbytes(rng.randrange(0, 200))]
        elif kind == 1:
            parts = [valid_frame[: rng.randrange(0, len(valid_frame))]]
        elif kind == 2:
            payload = valid_msg[: rng.randrange(0, len(valid_msg))]
            parts = [m.encode_frame(m.Frame(rng.randrange(1 << 40), payload))]
        elif kind == 3:
            junk = {"type": rng.choice(["hs_req", "done", "lease", "x", 7]), "engine_id": rng.choice([1, None, "e"])}
            parts = [m.encode_frame(m.Frame(5, msgspec.msgpack.encode(junk)))]
        elif kind == 4:
            parts = [msgspec.msgpack.encode([rng.randrange(-(1 << 63), 1 << 63), rng.randbytes(8), "x", -1, None])]
        else:
            parts = [rng.randbytes(8) for _ in range(rng.randrange(2, 4))]  # multi-part garbage
        out.append(parts)
    return out


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "authenticated"])
def test_fuzz_10000_random_and_truncated_payloads_then_valid_request(secret, request):
    server = request.getfixturevalue("secure_server" if secret else "server")
    seed = int(os.environ.get("KVBRIDGE_TEST_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed={seed}")
    payloads = _fuzz_payloads(random.Random(seed), 10_000)
    sock = _raw_dealer(server.address)
    num_replies = 0
    try:
        for start in range(0, len(payloads), 200):  # stay under the high-water marks
            batch = payloads[start : start + 200]
            for parts in batch:
                sock.send_multipart(parts)
            for _ in batch:
                assert sock.poll(5000), f"server stopped answering (seed={seed})"
                reply = m.decode(m.decode_frame(sock.recv()).payload)
                assert isinstance(reply, (m.ErrorReply, m.Ack, m.Pong)), reply
                num_replies += 1
    finally:
        sock.close(0)
    assert num_replies == 10_000
    assert server.num_rejected > 5000
    client = _client(server.address, secret)
    try:
        assert client.request(m.Ping(engine_id="after")) == m.Pong(engine_id="after")
    finally:
        client.close()


def test_oversized_input_is_dropped_and_server_keeps_serving():
    srv = SideChannelServer("127.0.0.1", 0, _handler, max_message_bytes=64 << 10)
    sock = _raw_dealer(srv.address)
    client = _client(srv.address, timeout_s=2.0)
    try:
        sock.send(b"\x00" * (1 << 20))
        assert not sock.poll(300)  # dropped (ZMQ disconnects that peer), no reply
        assert client.request(m.Ping(engine_id="still")) == m.Pong(engine_id="still")
        with pytest.raises(MalformedMessageError, match="exceeds"):
            SideChannelClient(srv.address, max_message_bytes=64 << 10).request(
                _done(*["x" * 100] * 1000)
            )
    finally:
        sock.close(0)
        client.close()
        srv.close()


@pytest.mark.parametrize("client_secret", [None, b"wrong-secret-of-thirty-two-bytes!"])
def test_unauthenticated_clients_are_refused(secure_server, client_secret, caplog):
    client = _client(secure_server.address, client_secret)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        with pytest.raises(AuthenticationError, match="KVBRIDGE_SIDE_CHANNEL_SECRET"):
            client.request(m.Ping(engine_id="x"))
    client.close()
    assert "refused" in caplog.text
    assert SECRET.decode() not in caplog.text and "wrong-secret-of" not in caplog.text


def test_authenticated_client_is_served_and_unsigned_server_is_refused(secure_server, server):
    good = _client(secure_server.address, SECRET)
    assert good.request(m.Ping(engine_id="ok")) == m.Pong(engine_id="ok")
    good.close()
    to_open_server = _client(server.address, SECRET)  # the peer does not sign: do not trust it
    with pytest.raises(AuthenticationError, match="refused"):
        to_open_server.request(m.Ping(engine_id="x"))
    to_open_server.close()


def test_replayed_message_is_rejected(secure_server):
    frame = FrameSigner(SECRET).seal(REQ, 42, m.encode(_done("r")))
    data = m.encode_frame(frame)
    sock = _raw_dealer(secure_server.address)
    try:
        replies = []
        for _ in range(2):
            sock.send(data)
            assert sock.poll(2000)
            replies.append(m.decode(m.decode_frame(sock.recv()).payload))
    finally:
        sock.close(0)
    assert replies[0] == m.Ack(count=1)
    assert isinstance(replies[1], m.ErrorReply) and replies[1].code == m.ErrorCode.AUTH
    assert "replayed" in replies[1].message


def test_signer_window_replay_and_bounded_nonce_cache():
    now = [10**12]
    signer = FrameSigner(SECRET, window_s=1.0, max_nonces=3, clock_ns=lambda: now[0])
    verifier = FrameSigner(SECRET, window_s=1.0, max_nonces=3, clock_ns=lambda: now[0])
    frames = []
    for i in range(5):
        now[0] += 1000  # distinct timestamps, well inside the window
        frames.append(signer.seal(REQ, i, b"p"))
    for f in frames[:4]:
        verifier.verify(REQ, f)  # the 4th evicts the 1st and raises the floor to its timestamp
    with pytest.raises(AuthenticationError, match="replayed|window"):
        verifier.verify(REQ, frames[0])  # evicted, but still refused: at or below the floor
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(REQ, frames[3])
    now[0] += 2 * 10**9
    with pytest.raises(AuthenticationError, match="window"):
        verifier.verify(REQ, frames[4])  # too old now
    tampered = m.Frame(9, b"q", frames[4].nonce, now[0], frames[4].mac)
    with pytest.raises(AuthenticationError, match="wrong signature"):
        verifier.verify(REQ, tampered)
    FrameSigner(None).verify(REQ, tampered)  # no secret: no authentication


@pytest.fixture
def addressed_server():
    srv = SideChannelServer("127.0.0.1", 0, _handler, SECRET, audience=AUDIENCE)
    yield srv
    srv.close()


def _send_raw(address: str, frame: m.Frame) -> m.Message:
    sock = _raw_dealer(address)
    try:
        sock.send(m.encode_frame(frame))
        assert sock.poll(2000)
        return m.decode(m.decode_frame(sock.recv()).payload)
    finally:
        sock.close(0)


def test_signed_requests_are_bound_to_their_destination_instance(addressed_server):
    signer = FrameSigner(SECRET)
    assert _send_raw(addressed_server.address, signer.seal(REQ, 1, m.encode(_done("r")), AUDIENCE)) == m.Ack(count=1)
    # the same secret, but meant for another node or for an earlier instance of this one
    for audience in (audience_of("prefill-1", "inc-1"), audience_of("prefill-0", "inc-0"), b""):
        reply = _send_raw(addressed_server.address, signer.seal(REQ, 2, m.encode(_done("r")), audience))
        assert isinstance(reply, m.ErrorReply) and reply.code == m.ErrorCode.AUTH, audience
        assert "another node" in reply.message
    # a ping may name nobody: it only says who answers, so that a client can address what follows
    assert _send_raw(addressed_server.address, signer.seal(REQ, 3, m.encode(m.Ping(engine_id="p")))) == m.Pong(engine_id="p")
    handshake = m.HandshakeRequest(protocol_version=2, engine_id="d", compat_hash="h")
    reply = _send_raw(addressed_server.address, signer.seal(REQ, 4, m.encode(handshake)))  # unaddressed: refused
    assert isinstance(reply, m.ErrorReply) and reply.code == m.ErrorCode.AUTH
    client = _client(addressed_server.address, SECRET)
    try:
        assert client.request(_done("a"), audience=AUDIENCE) == m.Ack(count=1)
        with pytest.raises(AuthenticationError, match="another node"):
            client.request(_done("a"), audience=audience_of("prefill-0", "restarted"))
    finally:
        client.close()


def test_a_reply_is_accepted_only_for_the_request_it_answers():
    """A captured reply, replayed as the answer to a later request, is refused by the client."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = _client(f"tcp://127.0.0.1:{port}", SECRET, timeout_s=2.0)
    signer = FrameSigner(SECRET)
    captured = signer.seal(FrameKind.REPLY, 1, m.encode(m.Ack(count=99)), audience=b"n" * 16)  # answered some other request
    errors = []

    def serve():
        ident, data = router.recv_multipart()
        request = m.decode_frame(data)
        replayed = m.Frame(request.corr_id, captured.payload, captured.nonce, captured.timestamp_ns, captured.mac,
                           captured.audience)  # fmt: skip
        router.send_multipart([ident, m.encode_frame(replayed)])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client.request(m.Ping(engine_id="x"))
    except AuthenticationError as e:
        errors.append(e)
    finally:
        thread.join(5)
        client.close()
        router.close(0)
    assert errors, "a reply signed for another request was accepted"


def test_with_a_secret_an_unsigned_error_reply_is_not_believed():
    """A peer (or a forger racing it) that answers with an unsigned ErrorReply: the client refuses the
    reply itself and never repeats what it says (it could say anything: 'auth', 'incompatible'...)."""
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")

    def answer_unsigned() -> None:
        if fake.poll(5000):
            ident, data = fake.recv_multipart()
            corr_id = msgspec.msgpack.decode(data)[0]
            forged = m.encode(m.ErrorReply(code=m.ErrorCode.AUTH, message="FORGED: your secret is wrong"))
            fake.send_multipart([ident, m.encode_frame(m.Frame(corr_id, forged))])

    thread = threading.Thread(target=answer_unsigned)
    thread.start()
    client = SideChannelClient(f"tcp://127.0.0.1:{port}", secret=b"s" * 32, timeout_s=5.0, retries=0)
    try:
        with pytest.raises(AuthenticationError) as info:
            client.request(m.Ping(engine_id="me"))
        assert "FORGED" not in str(info.value) and "unsigned" in str(info.value)
    finally:
        thread.join()
        client.close()
        fake.close(0)


def _exchange(address: str, frame: m.Frame) -> m.Frame:
    """Send `frame` as it is; the raw frame that answers it."""
    sock = _raw_dealer(address)
    try:
        sock.send(m.encode_frame(frame))
        assert sock.poll(2000)
        return m.decode_frame(sock.recv())
    finally:
        sock.close(0)


def test_a_frame_that_fails_verification_gets_no_signed_reply(addressed_server):
    """Whoever lacks the secret never obtains a signed frame: not for a garbage MAC, not for a frame
    signed for another node, whatever nonce (the reply's audience) it chose."""
    signer = FrameSigner(SECRET)
    attempts = [
        m.Frame(1, m.encode(m.Ping(engine_id="x")), AUDIENCE, time.time_ns(), os.urandom(32)),  # nonce = our audience
        m.Frame(2, m.encode(m.Ping(engine_id="x"))),  # unsigned
        signer.seal(REQ, 3, m.encode(_done("r")), audience_of("prefill-9", "inc-1")),  # for another node
    ]
    for frame in attempts:
        reply = _exchange(addressed_server.address, frame)
        assert not reply.mac and not reply.nonce, f"frame {frame.corr_id} got a signed reply"
        assert m.decode(reply.payload).code == m.ErrorCode.AUTH
    # a verified request still gets a signed answer, its refusals included
    reply = _exchange(addressed_server.address, signer.seal(REQ, 4, m.encode(m.Ping(engine_id="x"))))
    assert reply.mac and reply.audience


def test_a_signed_reply_is_never_a_valid_request(addressed_server):
    """Requests and replies are signed in separate MAC domains: a reply, even one whose audience names
    this very node, is refused as a request."""
    # what an attacker would capture: the signed answer to its own bad frame, nonce = this node's audience
    bait = m.Frame(1, m.encode(_done("r")), AUDIENCE, time.time_ns(), os.urandom(32))
    captured = _exchange(addressed_server.address, bait)
    replayed = m.Frame(captured.corr_id, captured.payload, captured.nonce, captured.timestamp_ns, captured.mac,
                       captured.audience)  # fmt: skip
    reply = m.decode(_exchange(addressed_server.address, replayed).payload)
    assert isinstance(reply, m.ErrorReply) and reply.code == m.ErrorCode.AUTH, reply
    # a genuine reply, signed with the secret for this node's audience, is no request either
    as_reply = FrameSigner(SECRET).seal(FrameKind.REPLY, 3, m.encode(_done("r")), AUDIENCE)
    reply = m.decode(_exchange(addressed_server.address, as_reply).payload)
    assert isinstance(reply, m.ErrorReply) and reply.code == m.ErrorCode.AUTH and "signature" in reply.message, reply
    assert addressed_server.num_requests == 0, "a reply was handled as a request"
