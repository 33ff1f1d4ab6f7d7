"""Wire messages: round trips, tagged dispatch, malformed input, and schema evolution across versions."""

from __future__ import annotations

from typing import Union

import msgspec
import pytest

from kvbridge.errors import IncompatiblePeerError, MalformedMessageError
from kvbridge.transfer import messages as m


def _handshake_response() -> m.HandshakeResponse:
    region = m.KVRegion(base_addr=0x7F00_0000_0000, nbytes=1 << 20, device_id=1, mem_type="VRAM")
    return m.HandshakeResponse(
        protocol_version=2, engine_id="prefill-0", incarnation="cd" * 16, compat_hash="ab" * 16, agent_name="prefill-0",
        agent_metadata=b"\x00\x01nixl", regions=[region], num_blocks=8, block_nbytes=1 << 17,
    )


LEASE_A = m.LeaseRef(req_id="a", token="t" * 64, block_ids=[3, 4], block_hash="ab" * 16)
LEASE_B = m.LeaseRef(req_id="b", token="u" * 64, block_ids=[7], block_hash="cd" * 16)


@pytest.mark.parametrize(
    "msg",
    [
        m.HandshakeRequest(protocol_version=1, engine_id="d", compat_hash="h", agent_name="d", agent_metadata=b"x"),
        _handshake_response(),
        m.LeaseRenew(engine_id="d", incarnation="i", leases=[LEASE_A, LEASE_B]),
        m.LeaseRenewReply(held=["a"], pending=["c"], unknown=["b"]),
        m.TransferDone(engine_id="d", incarnation="i", leases=[LEASE_A], failed_leases=[LEASE_B]),
        m.TransferDoneReply(released=["a"], pending=["c"], unknown=["b"]),
        m.Ack(count=3),
        m.Ping(engine_id="d"),
        m.Pong(engine_id="p"),
        m.ErrorReply(code=m.ErrorCode.INCOMPATIBLE, message="nope"),
    ],
)
def test_every_message_round_trips(msg):
    assert m.decode(m.encode(msg)) == msg


def test_match_dispatch_on_decoded_messages():
    def kind(data: bytes) -> str:
        match m.decode(data):
            case m.HandshakeRequest(engine_id=eid):
                return f"handshake from {eid}"
            case m.TransferDone(leases=leases):
                return f"done {[lease.req_id for lease in leases]}"
            case _:
                return "other"

    assert kind(m.encode(m.TransferDone(engine_id="d", incarnation="i", leases=[LEASE_A]))) == "done ['a']"
    assert kind(m.encode(m.HandshakeRequest(protocol_version=1, engine_id="d", compat_hash="h"))) == "handshake from d"
    assert kind(m.encode(m.Ping())) == "other"


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"garbage", msgspec.msgpack.encode({"type": "nope"}), msgspec.msgpack.encode({"type": "done2"}),
     msgspec.msgpack.encode({"type": "done2", "engine_id": 3, "incarnation": "i"}), msgspec.msgpack.encode([1, 2]),
     msgspec.msgpack.encode({"type": "done2", "engine_id": "d", "incarnation": "i", "leases": [{"req_id": "a"}]}),
     # version 1's release named a request id alone: no longer a message at all
     msgspec.msgpack.encode({"type": "done", "engine_id": "d", "req_ids": ["a"]})],
)
def test_malformed_bytes_raise_named_error(data):
    with pytest.raises(MalformedMessageError):
        m.decode(data)


def test_frame_round_trip_and_malformed_frame():
    frame = m.Frame(7, b"payload", b"n" * 16, 123, b"mac", b"engine/incarnation")
    assert m.decode_frame(m.encode_frame(frame)) == frame
    with pytest.raises(MalformedMessageError):
        m.decode_frame(b"\x93\x01")


# --- schema evolution: an "old" (v1) and a "new" struct set with the same tags ---------------


class _Base(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class OldDone(_Base, tag="done"):
    engine_id: str
    req_ids: list[str]


class OldPing(_Base, tag="ping"):
    engine_id: str = ""


class NewDone(_Base, tag="done"):
    engine_id: str
    req_ids: list[str]
    failed_req_ids: list[str] = []
    bytes_read: int = 0  # a field added later, with a default


class NewPing(_Base, tag="ping"):
    engine_id: str = ""


class NewStats(_Base, tag="stats"):  # a message type old peers do not know
    n: int = 0


OLD = msgspec.msgpack.Decoder(Union[OldDone, OldPing])
NEW = msgspec.msgpack.Decoder(Union[NewDone, NewPing, NewStats])


def test_old_message_decodes_on_new_peer_with_defaults():
    new = NEW.decode(msgspec.msgpack.encode(OldDone(engine_id="d", req_ids=["a"])))
    assert new == NewDone(engine_id="d", req_ids=["a"], failed_req_ids=[], bytes_read=0)


def test_new_message_decodes_on_old_peer_ignoring_new_fields():
    old = OLD.decode(msgspec.msgpack.encode(NewDone(engine_id="d", req_ids=["a"], bytes_read=5)))
    assert old == OldDone(engine_id="d", req_ids=["a"])


def test_new_message_type_is_malformed_for_old_peer():
    with pytest.raises(msgspec.ValidationError):
        OLD.decode(msgspec.msgpack.encode(NewStats(n=1)))


def test_real_messages_ignore_unknown_fields_from_newer_peers():
    data = msgspec.msgpack.encode({"type": "done2", "engine_id": "d", "incarnation": "i", "future_field": [1, 2]})
    assert m.decode(data) == m.TransferDone(engine_id="d", incarnation="i")


def test_version_negotiation(monkeypatch):
    assert m.negotiate_version(m.PROTOCOL_VERSION, m.MIN_PROTOCOL_VERSION) == m.PROTOCOL_VERSION
    assert m.negotiate_version(m.PROTOCOL_VERSION + 5, m.MIN_PROTOCOL_VERSION) == m.PROTOCOL_VERSION
    with pytest.raises(IncompatiblePeerError, match="upgrade"):
        m.negotiate_version(m.PROTOCOL_VERSION + 5, m.PROTOCOL_VERSION + 1)  # peer dropped our version
    monkeypatch.setattr(m, "MIN_PROTOCOL_VERSION", 2)
    monkeypatch.setattr(m, "PROTOCOL_VERSION", 3)
    with pytest.raises(IncompatiblePeerError):
        m.negotiate_version(1, 1)  # peer too old for us
    assert m.negotiate_version(2, 1) == 2
