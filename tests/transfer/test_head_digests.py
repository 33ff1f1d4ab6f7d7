"""A lease's per-head digests (what a decode rank holding only some of a prefill rank's KV heads checks)
equal the digests of the heads a reader rebuilds from its own pages, for every page format (marker `nixl`:
the endpoint registers its KV with a NIXL agent)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import WSUM, XXH3, block_digests
from kvbridge.transfer.head_digests import head_block_digests
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.layout_gather import rebuild_blocks

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("alg", [XXH3, WSUM])
@pytest.mark.parametrize("page_format", ["2NHD", "H2ND", "2HND"])
def test_per_head_digests_are_what_a_reader_of_one_head_rebuilds(page_format, alg):
    from kvbridge.transfer.endpoint import KVEndpoint

    seed = 4
    print(f"seed {seed}")
    torch.manual_seed(seed)
    layout = KVCacheLayout(num_blocks=12, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8, dtype="float32", page_format=page_format)
    ep = KVEndpoint(f"heads-{page_format}", "m", torch.randn(layout.shape), layout, serve=False, kv_head_start=4, num_total_kv_heads=8)
    ep.digest_alg = alg  # wsum64 is a GPU owner's: its heads are their words' shares of the block's sum
    try:
        ids = [7, 2, 9]
        digest = ep.digest_lease(ids)
        assert len(digest.head_values) == 4 and digest.values == ep.digest_blocks(ids).values
        for local_head in range(4):  # a reader holding all four heads rebuilds global head 4 + local_head alone
            one = KVShard(_one_head(layout), 4 + local_head, 8)
            blocks, rebuilt = rebuild_blocks(ep._region_bytes, ep.shard, ids, one, len(ids))
            assert head_block_digests(blocks, rebuilt, layout, local_head, alg) == digest.head_values[local_head]
            if alg == XXH3:  # a head's own bytes, hashed
                assert block_digests(blocks, rebuilt, np.arange(len(ids)), alg).values == digest.head_values[local_head]
        if alg == WSUM:  # the heads add up to the block
            assert [sum(h) & (2**64 - 1) for h in zip(*digest.head_values)] == digest.values
        assert ep.digest_lease(ids, per_head=False).head_values == []  # digest_kv_heads off
    finally:
        ep.close()


def _one_head(layout: KVCacheLayout) -> KVCacheLayout:
    return dataclasses.replace(layout, num_kv_heads=1)


@pytest.mark.parametrize("alg", [XXH3, WSUM])
@pytest.mark.parametrize("page_format", ["2NHD", "H2ND"])
def test_blocks_held_one_tensor_per_layer_give_the_same_lease_digests(page_format, alg):
    """vLLM's default model runner allocates each layer alone (`LayerTensors`): a lease's digests, each
    head's too, are those of the same bytes in one block-major buffer (a grant once raised here)."""
    from kvbridge.layer_tensors import LayerTensors
    from kvbridge.transfer.digest import region_bytes
    from kvbridge.transfer.head_digests import lease_digests

    torch.manual_seed(5)
    layout = KVCacheLayout(num_blocks=40, num_layers=3, block_size=16, num_kv_heads=4, head_dim=8, dtype="float32", page_format=page_format)
    per_layer = KVCacheLayout.per_layer(layout.page_nbytes, **{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)
                                                               if f.name not in ("layer_stride", "block_stride")})  # fmt: skip
    kv = torch.randn(layout.shape)  # block-major: [blocks, layers, *page]
    layers = LayerTensors([kv[:, i].clone() for i in range(layout.num_layers)], per_layer)
    ids = [31, 2, 3, 4, 17, 39, 0]
    want = lease_digests(region_bytes(kv, layout), layout, ids, alg)
    got = lease_digests(region_bytes(layers, per_layer), per_layer, ids, alg)
    assert got.values == want.values and got.head_values == want.head_values and len(got.head_values) == 4
    with pytest.raises(IndexError):
        lease_digests(region_bytes(layers, per_layer), per_layer, [40], alg)
