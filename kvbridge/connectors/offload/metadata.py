"""The per-step plan the offload scheduler side hands its worker side. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.block_hash import BlockHash
from kvbridge.connectors.base import KVConnectorMetadata


@dataclass
class StoreJob:
    """Copy GPU blocks -> host slots after this step's forward pass (then, optionally, to disk).

    The i-th GPU block goes to the i-th slot and holds the block whose hash is `hashes[i]`.
    """

    req_id: str
    gpu_block_ids: list[int]
    slots: list[int]
    hashes: list[BlockHash]
    write_to_disk: list[bool]  # write the slot through to the disk tier once the store completed

    def __post_init__(self) -> None:
        assert len(self.gpu_block_ids) == len(self.slots) == len(self.hashes) == len(self.write_to_disk)


@dataclass
class LoadJob:
    """Copy host slots -> GPU blocks, reading `from_disk` blocks into their slot first.

    `failed_gpu_block_ids` are blocks the scheduler side could not serve after all (no free slot
    for a disk read); the worker reports them as load errors right away.
    """

    req_id: str
    gpu_block_ids: list[int]
    slots: list[int]
    hashes: list[BlockHash]
    from_disk: list[bool]
    failed_gpu_block_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.gpu_block_ids) == len(self.slots) == len(self.hashes) == len(self.from_disk)

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_block_ids) + len(self.failed_gpu_block_ids)


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)  # started in start_load_kv
    stores: list[StoreJob] = field(default_factory=list)  # started in wait_for_save, after the forward
    # Requests preempted since the last step: their GPU blocks were freed, so the worker finishes
    # their in-flight stores before this step's forward may overwrite those blocks.
    wait_for_req_ids: set[str] = field(default_factory=set)
    disk_deletes: list[BlockHash] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.wait_for_req_ids or self.disk_deletes)
