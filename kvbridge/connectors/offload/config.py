"""Options of the OffloadingConnector, read from `KVTransferConfig.extra`. Pure, no torch.

    KVTransferConfig(connector="OffloadingConnector", extra={
        "host_capacity_bytes": 8 << 30,   # or "host_num_blocks": 4096
        "eviction_policy": "arc",         # "lru" (default) or "arc"
        "disk_dir": "/var/cache/kvbridge", # optional disk tier under the host tier
        "disk_capacity_bytes": 100 << 30,  # or "disk_num_blocks"; default: unbounded
        "verify_kv_digest": True,          # default: a loaded block is used only when its bytes match
    })
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.connectors.options import options_from_extra
from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout

DEFAULT_HOST_CAPACITY_BYTES = 1 << 30


@dataclass(frozen=True)
class OffloadConfig:
    host_num_blocks: int | None = None  # capacity of the host tier in blocks ...
    host_capacity_bytes: int | None = None  # ... or in bytes (needs the KV layout to convert)
    eviction_policy: str = "lru"
    disk_dir: str | None = None
    disk_num_blocks: int | None = None
    disk_capacity_bytes: int | None = None
    staging_blocks: int = 64  # CUDA: blocks gathered per DMA through the device staging buffer
    pin_memory: bool | None = None  # None: pin the host pool when the KV cache is on CUDA
    copy_threads: int | None = None  # CPU KV cache: threads that copy blocks (None: one per core it may run on)
    # Digest every block as it is stored and check it as it is loaded back; a mismatch is a miss.
    verify_kv_digest: bool = True
    debug_store_delay_s: float = 0.0  # test hook: each store sleeps this long on the copy thread
    debug_load_delay_s: float = 0.0  # test hook: each load sleeps this long

    def __post_init__(self) -> None:
        if self.host_num_blocks is not None and self.host_capacity_bytes is not None:
            raise ConfigError("OffloadingConnector: give extra.host_num_blocks or extra.host_capacity_bytes, not both")
        if self.disk_num_blocks is not None and self.disk_capacity_bytes is not None:
            raise ConfigError("OffloadingConnector: give extra.disk_num_blocks or extra.disk_capacity_bytes, not both")
        for name in ("host_num_blocks", "host_capacity_bytes", "disk_num_blocks", "disk_capacity_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"OffloadingConnector: extra.{name} must be a positive integer, got {value!r}")
        if self.eviction_policy.lower() not in ("lru", "arc"):
            raise ConfigError(
                f"OffloadingConnector: extra.eviction_policy={self.eviction_policy!r}; expected 'lru' or 'arc'"
            )
        if self.staging_blocks <= 0:
            raise ConfigError(f"OffloadingConnector: extra.staging_blocks must be positive, got {self.staging_blocks}")
        if self.copy_threads is not None and (not isinstance(self.copy_threads, int) or self.copy_threads <= 0):
            raise ConfigError(f"OffloadingConnector: extra.copy_threads must be a positive integer, got {self.copy_threads!r}")
        if self.debug_store_delay_s < 0 or self.debug_load_delay_s < 0:
            raise ConfigError("OffloadingConnector: debug delays must be >= 0")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> OffloadConfig:
        return options_from_extra(cls, extra, "OffloadingConnector")

    @property
    def has_disk(self) -> bool:
        return self.disk_dir is not None

    def num_host_blocks(self, block_nbytes: int | None) -> int:
        """Host tier capacity in blocks. `block_nbytes` is needed only when the capacity is in bytes."""
        if self.host_num_blocks is not None:
            return self.host_num_blocks
        return _bytes_to_blocks(self.host_capacity_bytes or DEFAULT_HOST_CAPACITY_BYTES, block_nbytes, "host")

    def num_disk_blocks(self, block_nbytes: int | None) -> int | None:
        """Disk tier capacity in blocks; None means unbounded."""
        if self.disk_num_blocks is not None:
            return self.disk_num_blocks
        if self.disk_capacity_bytes is None:
            return None
        return _bytes_to_blocks(self.disk_capacity_bytes, block_nbytes, "disk")


def _bytes_to_blocks(nbytes: int, block_nbytes: int | None, tier: str) -> int:
    if block_nbytes is None:
        raise ConfigError(
            f"OffloadingConnector: the {tier} capacity is given in bytes but the engine did not pass the KV "
            f"layout (ConnectorContext.layout); give extra.{tier}_num_blocks instead"
        )
    num = nbytes // block_nbytes
    if num <= 0:
        raise ConfigError(
            f"OffloadingConnector: {tier} capacity {nbytes} B holds no block of {block_nbytes} B; raise it"
        )
    return num


def block_nbytes_of(layout: KVCacheLayout | None) -> int | None:
    return None if layout is None else layout.block_nbytes
