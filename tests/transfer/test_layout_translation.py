"""Reads between engines whose KV pages differ, over real NIXL/UCX between two OS processes (marker `nixl`).

The owner (tests/transfer/peer_process.py) holds kvbridge-engine pages ("2NHD", block-major,
16-token blocks); this process reads them into vLLM-CPU-shaped pages, layer-outermost with 32-token
blocks: "H2ND", and "H2ND-KT" (each head's K transposed, as vLLM's CPU VEC kernels write it). The
handshake accepts the pair by model hash, the endpoint plans the read
(layout_plan.py: STAGED here), and every token of every layer and head must land where the
decode's layout puts it, with every other byte untouched. The reader then rebuilds the owner's
blocks from its own pages and must get the owner's own lease digests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvbridge.errors import IncompatiblePeerError
from kvbridge.transfer.options import TransferOptions
from kvbridge.transfer.tracker import TransferState

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.nixl

sys.path.insert(0, str(Path(__file__).parent))
from peer_process import allocate_kv, fill_kv, make_layout  # noqa: E402
from test_endpoint import MODEL, Peer, _wait_final  # noqa: E402

OWNER = {"num_blocks": 64, "num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 8}  # 2NHD, block-major
READER = {**OWNER, "num_blocks": 32, "block_size": 32, "page_format": "H2ND", "layer_major": True}


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    p = Peer(tmp_path_factory.mktemp("owner"), engine_id="prefill-2nhd", seed=5, **OWNER)
    try:
        yield p
    finally:
        p.quit()


def _reader(engine_id: str, spec: dict):
    from kvbridge.transfer.endpoint import KVEndpoint

    layout = make_layout(spec)
    kv = allocate_kv(layout)
    return KVEndpoint(engine_id, MODEL, kv, layout, secret=None, options=TransferOptions()), kv


def _tokens(kv, layout, block_ids, num_tokens):
    """[T, layers, 2, heads, head_dim] int16: the KV of tokens [0, T), whatever the page format."""
    t = torch.arange(num_tokens)
    blocks, slots = torch.tensor(block_ids)[t // layout.block_size], t % layout.block_size
    pages = kv.view(torch.int16)[blocks]  # [T, L, *page_shape]
    if layout.page_format == "2NHD":  # [T, L, 2, N, H, D]
        return pages[t, :, :, slots]  # [T, L, 2, H, D]
    if layout.page_format == "H2ND-KT":  # [T, L, H, 2, N * D]: each head's K is [D, N], its V [N, D]
        n, d = layout.block_size, layout.head_dim
        k = pages[:, :, :, 0].flatten(-2).unflatten(-1, (d, n))[t, :, :, :, slots]  # [T, L, H, D]
        v = pages[:, :, :, 1][t, :, :, slots]  # [T, L, H, D]
        return torch.stack([k, v], dim=2)  # [T, L, 2, H, D]
    assert layout.page_format == "H2ND"  # [T, L, H, 2, N, D]
    return pages[t, :, :, :, slots].permute(0, 1, 3, 2, 4)  # [T, L, 2, H, D]


@pytest.mark.parametrize("page_format", ["H2ND", "H2ND-KT"])  # H2ND-KT: vLLM's CPU pages under its VEC kernels
def test_a_2nhd_owner_is_read_into_layer_major_h2nd_pages_of_twice_the_block_size(owner, page_format):
    ep, kv = _reader(f"decode-{page_format}", {**READER, "page_format": page_format})
    try:
        remote_ids, local_ids = [3, 4, 5, 20, 9], [7, 2, 30]  # 80 tokens: 5 owner blocks, 3 reader blocks
        rec = _wait_final(ep, ep.read_blocks("x-read", owner.address, local_ids, remote_ids).req_id)
        assert rec.state is TransferState.DONE, rec.error
        stats = ep.get_stats()
        assert stats["num_staged_plan_reads"] == 1 and stats["num_direct_plan_reads"] == 0
        assert rec.num_descriptors == 3 == stats["num_plan_descriptors"]  # runs of owner blocks: [3, 4, 5], [20], [9]

        owner_layout = make_layout(OWNER)
        expected = allocate_kv(owner_layout)
        fill_kv(expected, 5)
        reader_layout = make_layout({**READER, "page_format": page_format})
        assert torch.equal(_tokens(kv, reader_layout, local_ids, 80), _tokens(expected, owner_layout, remote_ids, 80))
        kv16 = kv.view(torch.int16)
        untouched = sorted(set(range(32)) - set(local_ids))
        assert not kv16[untouched].any()
        assert not _tokens(kv, reader_layout, [30], 32)[16:].any()  # the third block holds tokens 64..79 only

        digests = owner.ask("block_digests", ids=remote_ids)
        got = ep.start_read_digest(owner.address, local_ids, remote_ids, digests["alg"]).result()
        assert list(got.values) == digests["values"]
        kv16[2, 1, 0, 1, 19, 0] ^= 1  # one bit of token 32 + 19 = 51, i.e. of the owner's 4th block (id 20)
        got = ep.start_read_digest(owner.address, local_ids, remote_ids, digests["alg"]).result()
        assert [i for i, (a, b) in enumerate(zip(got.values, digests["values"])) if a != b] == [3]
    finally:
        ep.close()


def test_a_peer_of_another_model_is_refused_at_the_handshake_naming_both_layouts(owner):
    ep, _ = _reader("decode-other-model", {**READER, "head_dim": 16})
    try:
        with pytest.raises(IncompatiblePeerError) as err:
            ep.handshake(owner.address)
        assert "head_dim 8" in str(err.value) and "head_dim 16" in str(err.value)
    finally:
        ep.close()


def test_opaque_pages_are_refused_at_the_handshake_naming_both_layouts(owner):
    """vLLM CPU pages of kernels whose tiling is not mapped: their model hash names the format, so no plan is tried."""
    ep, _ = _reader("decode-opaque", {**READER, "page_format": "vllm-cpu-amx"})
    try:
        with pytest.raises(IncompatiblePeerError) as err:
            ep.handshake(owner.address)
        assert "vllm-cpu-amx pages" in str(err.value) and "2NHD pages" in str(err.value)
    finally:
        ep.close()


def test_a_read_too_large_to_plan_fails_that_read_only(owner, monkeypatch):
    from kvbridge.transfer import layout_plan

    ep, kv = _reader("decode-too-large", {**READER, "page_format": "H2ND-KT"})
    try:
        monkeypatch.setattr(layout_plan, "MAX_PLAN_ENTRIES", 32)  # 2 layers x 2 pages + 32 tokens: 36
        rec = _wait_final(ep, ep.read_blocks("too-large", owner.address, [1], [3, 4]).req_id)
        assert rec.state is TransferState.FAILED and "PlanTooLargeError" in rec.error
        assert not kv.view(torch.int16)[1].any()
        monkeypatch.setattr(layout_plan, "MAX_PLAN_ENTRIES", 1 << 24)
        rec = _wait_final(ep, ep.read_blocks("fits", owner.address, [1], [3, 4]).req_id)
        assert rec.state is TransferState.DONE, rec.error
    finally:
        ep.close()


def test_unpaired_ids_for_a_peer_of_our_own_pages_fail_the_read_and_keep_the_peer(owner):
    """Lists of different lengths are for translated peers; for the others they are the caller's mistake."""
    ep, _ = _reader("decode-same-pages", OWNER)
    try:
        rec = _wait_final(ep, ep.read_blocks("unpaired", owner.address, [1, 2], [3]).req_id)  # peer not known yet
        assert rec.state is TransferState.FAILED and "pair them one to one" in rec.error
        assert owner.address in ep.peers  # the peer did nothing wrong
        with pytest.raises(ValueError, match="2 local block ids but 1"):  # now that it is known: at once
            ep.read_blocks("unpaired-again", owner.address, [1, 2], [3])
    finally:
        ep.close()
