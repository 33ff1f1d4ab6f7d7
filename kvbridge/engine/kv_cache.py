"""Sizing and allocating the engine's one KV cache tensor.

The geometry and every block -> byte-offset computation live in `kvbridge/layout.py`; this module
only decides how many blocks fit and allocates `torch.zeros(layout.shape)`.

How the block count is chosen (`num_kv_blocks`):

* `CacheConfig.num_blocks` when given;
* else `CacheConfig.memory_fraction` of the device's free memory: `torch.cuda.mem_get_info()` on
  CUDA (after the weights are loaded), on CPU of the host's available RAM (MemAvailable), capped
  at `CPU_KV_CAP_BYTES` so a CPU engine never claims most of a shared machine;
* else a default of `DEFAULT_KV_TOKENS` tokens (8192, i.e. 512 blocks of 16), on every device.
  It keeps tests and short-lived engines cheap; set `num_blocks` or `memory_fraction` for serving.
"""

from __future__ import annotations

import logging
import os

import torch

from kvbridge.config import DEFAULT_KV_TOKENS, CacheConfig
from kvbridge.engine.presets import ModelArgs
from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 8 * 1024**3


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo, or total physical memory where that file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_device_bytes(device: torch.device) -> int:
    """Bytes the KV cache may claim from: free CUDA memory, or capped available host RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return min(available_host_bytes(), CPU_KV_CAP_BYTES)


def num_kv_blocks(cache_config: CacheConfig, block_nbytes: int, device: torch.device) -> int:
    """How many blocks the cache gets (see the module docstring)."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    if cache_config.memory_fraction is not None:
        budget = int(free_device_bytes(device) * cache_config.memory_fraction)
        num_blocks = budget // block_nbytes
        if num_blocks < 2:
            raise ConfigError(
                f"CacheConfig.memory_fraction={cache_config.memory_fraction} leaves room for {num_blocks} KV blocks "
                f"of {block_nbytes} bytes on {device}; raise CacheConfig.memory_fraction or set CacheConfig.num_blocks"
            )
        return num_blocks
    return max(2, -(-DEFAULT_KV_TOKENS // cache_config.block_size))


def make_layout(args: ModelArgs, cache_config: CacheConfig, dtype: str, device: torch.device) -> KVCacheLayout:
    """The cache geometry for `args` in `dtype`, with the block count from `num_kv_blocks`."""
    one_block = KVCacheLayout(1, args.num_layers, cache_config.block_size, args.num_kv_heads, args.head_dim, dtype)
    num_blocks = num_kv_blocks(cache_config, one_block.block_nbytes, device)
    layout = one_block.with_num_blocks(num_blocks)
    logger.info("KV cache: %d blocks of %d tokens, %d bytes (%.1f MiB) on %s; %s", num_blocks, layout.block_size,
                layout.total_nbytes, layout.total_nbytes / 2**20, device, _sized_by(cache_config))  # fmt: skip
    return layout


def _sized_by(cache_config: CacheConfig) -> str:
    """How `num_kv_blocks` chose the size, for the start-up log line."""
    if cache_config.num_blocks is not None:
        return "CacheConfig.num_blocks as given"
    if cache_config.memory_fraction is not None:
        return f"CacheConfig.memory_fraction={cache_config.memory_fraction:g} of free memory"
    return f"the default of {DEFAULT_KV_TOKENS} tokens (set CacheConfig.num_blocks or CacheConfig.memory_fraction to size it)"


def allocate_kv_cache(layout: KVCacheLayout, device: torch.device) -> torch.Tensor:
    """Zeroed `layout.shape` tensor ([num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim])."""
    return torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=device)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """The strided per-layer view [num_blocks, 2, block_size, num_kv_heads, head_dim] attention reads."""
    return kv_cache[:, layer]
