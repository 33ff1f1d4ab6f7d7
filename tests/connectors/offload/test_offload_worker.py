"""The offload worker on a strided KV cache (vLLM's layer-outermost buffer): host tier and disk tier."""

from __future__ import annotations

import torch

from kvbridge.block_hash import BlockHash
from kvbridge.connectors.offload.config import OffloadConfig
from kvbridge.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvbridge.connectors.offload.worker import OffloadWorker
from kvbridge.layout import KVCacheLayout

PAGE = 2 * 4 * 2 * 8 * 2  # page_nbytes in bfloat16
LAYOUT = KVCacheLayout(8, 3, 4, 2, 8, "bfloat16", page_format="H2ND", layer_stride=8 * PAGE, block_stride=PAGE)
HASHES = [BlockHash(bytes([i]) * 16) for i in (1, 2, 3)]


def strided_kv(seed: int | None) -> torch.Tensor:
    """[8, 3, 2, 2, 4, 8] view of a layer-outermost buffer, as an engine adapter hands it over."""
    buffer = torch.zeros(LAYOUT.region_nbytes // 2, dtype=torch.bfloat16)
    if seed is not None:
        buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return buffer.as_strided(LAYOUT.shape, LAYOUT.strides)


def test_blocks_of_a_strided_cache_go_to_disk_and_come_back_into_another_one(tmp_path):
    config = OffloadConfig(host_num_blocks=4, disk_dir=str(tmp_path))
    source, writer = strided_kv(seed=3), OffloadWorker(config, "m", flush_timeout_s=10)
    writer.register_kv_caches(source, LAYOUT)
    assert writer.host.layout == LAYOUT.block_major(4) and writer.host.pool.is_contiguous()
    writer.wait_for_save(OffloadMetadata(stores=[StoreJob("r", [6, 1, 2], [0, 1, 2], HASHES, [True] * 3)]))
    assert writer.flush(10).is_complete
    writer.check_integrity()
    assert writer.get_stats()["bytes_stored"] == 3 * LAYOUT.block_nbytes
    writer.shutdown()

    target, reader = strided_kv(seed=None), OffloadWorker(config, "m", flush_timeout_s=10)
    reader.register_kv_caches(target, LAYOUT)  # an empty host tier: every block comes from disk
    reader.start_load_kv(OffloadMetadata(loads=[LoadJob("r2", [0, 4, 5], [3, 0, 1], HASHES, [True] * 3)]))
    assert reader.flush(10).is_complete
    assert reader.get_block_ids_with_load_errors() == set()
    for dst, src in zip([0, 4, 5], [6, 1, 2]):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(target[dst, layer], source[src, layer]), (dst, src, layer)
    assert not target[[1, 2, 3, 6, 7]].any()
    reader.check_integrity()
    reader.shutdown()
