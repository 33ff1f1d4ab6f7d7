"""Both halves of the handshake as pure functions: layouts (page format, strides) and old peers."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvbridge.errors import HandshakeError, IncompatiblePeerError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.handshake import LocalIdentity, answer_handshake, make_request, peer_from_response

MODEL = "m"
BLOCK_MAJOR = KVCacheLayout(16, 2, 4, 2, 8, "bfloat16", page_format="H2ND")
PAGE = BLOCK_MAJOR.page_nbytes
LAYER_MAJOR = dataclasses.replace(BLOCK_MAJOR, num_blocks=8, layer_stride=8 * PAGE, block_stride=PAGE)
PADDED = dataclasses.replace(BLOCK_MAJOR, layer_stride=PAGE, block_stride=2 * PAGE + 512)


def identity(layout: KVCacheLayout, engine_id: str = "owner") -> LocalIdentity:
    region = m.KVRegion(base_addr=1 << 30, nbytes=layout.region_nbytes)
    return LocalIdentity(engine_id, "inc", layout.compat_hash(MODEL), engine_id, b"md", region, layout)


@pytest.mark.parametrize("owner_layout", [LAYER_MAJOR, PADDED, BLOCK_MAJOR], ids=["layer-major", "padded", "block-major"])
def test_the_reader_builds_the_owners_layout_exactly(owner_layout):
    owner, reader = identity(owner_layout), identity(BLOCK_MAJOR.with_num_blocks(32), "reader")
    resp = answer_handshake(make_request(reader), owner)
    assert resp.protocol_version == m.PROTOCOL_VERSION == 3
    peer = peer_from_response(m.decode(m.encode(resp)), "tcp://owner", reader.compat_hash, reader.layout)
    assert peer.layout == owner_layout  # block count, page format and strides
    assert peer.layout.page_offsets(range(owner_layout.num_blocks)).tolist() == \
        owner_layout.page_offsets(range(owner_layout.num_blocks)).tolist()


def test_an_old_reader_is_refused_by_a_strided_owner_and_served_by_a_block_major_one():
    """Protocol 2 readers ignore the strides and would read block b at b * block_nbytes."""
    old_request = m.HandshakeRequest(protocol_version=2, min_protocol_version=2, engine_id="old",
                                     compat_hash=BLOCK_MAJOR.compat_hash(MODEL))
    for strided in (LAYER_MAJOR, PADDED):
        with pytest.raises(IncompatiblePeerError, match="protocol 2.*strided KV layout.*upgrade it to protocol 3"):
            answer_handshake(old_request, identity(strided))
    assert answer_handshake(old_request, identity(BLOCK_MAJOR)).protocol_version == 2


def test_an_old_owners_answer_is_block_major():
    """A protocol 2 owner sends no page format or strides: the defaults are what it has."""
    reader = identity(KVCacheLayout(16, 2, 4, 2, 8, "bfloat16"), "reader")
    new = answer_handshake(make_request(reader), identity(reader.layout.with_num_blocks(40)))
    wire = msgspec.msgpack.decode(m.encode(new))  # as a dict: what a protocol 2 owner would not send, dropped
    old_fields = {k: v for k, v in wire.items() if k not in ("page_format", "layer_stride", "block_stride")}
    old = m.decode(msgspec.msgpack.encode({**old_fields, "protocol_version": 2}))
    peer = peer_from_response(old, "tcp://old", reader.compat_hash, reader.layout)
    assert peer.protocol_version == 2 and peer.layout == KVCacheLayout(40, 2, 4, 2, 8, "bfloat16")
    assert peer.layout.is_contiguous


def _response(layout: KVCacheLayout, **changes) -> m.HandshakeResponse:
    resp = answer_handshake(make_request(identity(layout, "reader")), identity(layout))
    return msgspec.structs.replace(resp, **changes)


def test_invalid_or_mismatched_layouts_in_an_answer_are_named_errors():
    reader = identity(BLOCK_MAJOR, "reader")
    hash_ = reader.compat_hash
    with pytest.raises(HandshakeError, match="invalid KV layout.*overlap"):
        peer_from_response(_response(LAYER_MAJOR, layer_stride=PAGE), "tcp://p", hash_, BLOCK_MAJOR)
    with pytest.raises(HandshakeError, match="claims 8 blocks .* span"):
        small = m.KVRegion(base_addr=0, nbytes=LAYER_MAJOR.region_nbytes - 1)
        peer_from_response(_response(LAYER_MAJOR, regions=[small]), "tcp://p", hash_, BLOCK_MAJOR)
    with pytest.raises(HandshakeError, match="claims 0 blocks"):
        peer_from_response(_response(LAYER_MAJOR, num_blocks=0), "tcp://p", hash_, BLOCK_MAJOR)
    with pytest.raises(IncompatiblePeerError, match="'2NHD' KV pages, ours are 'H2ND'"):
        peer_from_response(_response(LAYER_MAJOR, page_format="2NHD"), "tcp://p", hash_, BLOCK_MAJOR)


def test_a_reader_that_does_not_translate_never_pairs_with_other_page_formats():
    """An older reader (no model hash) reads pages as they are: only the same compat hash will do."""
    vllm_cpu, kvbridge = identity(LAYER_MAJOR), identity(dataclasses.replace(BLOCK_MAJOR, page_format="2NHD"), "r")
    with pytest.raises(IncompatiblePeerError, match="compat hash"):
        answer_handshake(make_request(kvbridge), vllm_cpu)


def translating(layout: KVCacheLayout, engine_id: str = "owner", model: str = MODEL) -> LocalIdentity:
    return dataclasses.replace(identity(layout, engine_id), model_hash=layout.model_hash(model))


def test_readers_that_translate_pair_with_another_block_size_and_page_format_of_the_same_model():
    owner = translating(LAYER_MAJOR)  # H2ND, 4-token blocks, layer-outermost
    reader = translating(KVCacheLayout(32, 2, 8, 2, 8, "bfloat16"), "reader")  # 2NHD, 8-token blocks
    assert owner.compat_hash != reader.compat_hash
    resp = answer_handshake(make_request(reader), owner)
    peer = peer_from_response(m.decode(m.encode(resp)), "tcp://owner", reader.compat_hash, reader.layout, reader.model_hash)
    assert peer.layout == LAYER_MAJOR  # its block size, page format and strides, for the read plan


def test_another_model_is_refused_by_both_sides_naming_both_layouts():
    owner = translating(LAYER_MAJOR)
    reader = translating(KVCacheLayout(32, 2, 8, 2, 16, "bfloat16"), "reader")  # head_dim 16
    with pytest.raises(IncompatiblePeerError) as err:
        answer_handshake(make_request(reader), owner)
    assert "head_dim 16" in str(err.value) and "head_dim 8" in str(err.value)
    answer = answer_handshake(make_request(translating(LAYER_MAJOR, "twin")), owner)  # an answer to another reader
    with pytest.raises(IncompatiblePeerError) as err:  # the reader checks every answer too
        peer_from_response(answer, "tcp://owner", reader.compat_hash, reader.layout, reader.model_hash)
    assert "H2ND pages, 4-token blocks" in str(err.value) and "head_dim 16" in str(err.value)


def test_a_region_per_layer_must_name_every_layer_at_the_layouts_stride():
    per_layer = KVCacheLayout.per_layer(PAGE, num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                                        dtype="bfloat16", page_format="H2ND")  # fmt: skip
    reader = identity(per_layer, "reader")
    good = m.KVRegion(base_addr=1 << 30, nbytes=per_layer.layer_region_nbytes, layer_addrs=(1 << 30, 1 << 20),
                      layer_stride=per_layer.layer_stride_bytes)  # fmt: skip
    peer = peer_from_response(_response(per_layer, regions=[good]), "tcp://p", reader.compat_hash, per_layer)
    assert peer.region.layer_addrs == (1 << 30, 1 << 20)
    for bad in (msgspec.structs.replace(good, layer_addrs=(1 << 30,)),  # a layer missing
                msgspec.structs.replace(good, layer_stride=PAGE),  # another stride than the layout's
                msgspec.structs.replace(good, nbytes=per_layer.layer_region_nbytes - 1)):  # fmt: skip
        with pytest.raises(HandshakeError, match="layer region"):
            peer_from_response(_response(per_layer, regions=[bad]), "tcp://p", reader.compat_hash, per_layer)
