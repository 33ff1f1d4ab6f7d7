"""`NixlPoster`: how one transfer of block pairs becomes a NIXL post, in a descriptor mode.

- "blocks" (default): one prepared list per side with a descriptor per unit (a block, or a page
  when either side's blocks are not one byte range: `descriptors.transfer_unit`), made once (the
  peer's by `PeerDirectory`, cached per peer; ours here, on first use, per unit), posted by unit
  index; NIXL merges entries adjacent on both sides.
- "ranges": `descriptors.coalesce_blocks` turns the pairing into byte ranges, split at
  `max_descriptor_nbytes`; both lists are prepared per transfer and released with it.

docs/transfer.md has the measurements. Called by `KVEndpoint` on the owner's thread only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvbridge.errors import TransferError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.agent import NixlAgent
from kvbridge.transfer.descriptors import (
    Unit,
    block_descs,
    coalesce_blocks,
    num_merged_ranges,
    range_descs,
    transfer_unit,
    unit_indices,
)
from kvbridge.transfer.handshake import PeerInfo
from kvbridge.transfer.options import DescriptorMode, TransferOp


class NixlPost(NamedTuple):
    xfer: object  # NIXL transfer handle, for NixlAgent.poll
    dlists: tuple  # per-transfer lists ("ranges" mode), released with the transfer
    num_descriptors: int  # ranges after NIXL's merging ("blocks"), or ranges posted


class NixlPoster:
    def __init__(
        self,
        agent: NixlAgent,
        layout: KVCacheLayout,
        region: m.KVRegion,  # our registered KV tensor
        mode: DescriptorMode = DescriptorMode.BLOCKS,
        max_descriptor_nbytes: int | None = None,  # "ranges": split longer ranges
    ) -> None:
        self._agent, self._layout, self._region = agent, layout, region
        self.mode = mode
        self.max_descriptor_nbytes = max_descriptor_nbytes
        self._local_lists: dict[Unit, object] = {}  # "blocks" mode: our prepared list per unit

    def post(
        self, op: TransferOp, local_ids: np.ndarray, remote_ids: np.ndarray, peer: PeerInfo,
        remote_block_list: object | None,  # the peer's per-unit list ("blocks" mode, PeerDirectory.block_list)
    ) -> NixlPost:
        """Post READ or WRITE of the paired blocks. Raises
        TransferError when NIXL refuses (nothing is left prepared then)."""
        mine = self._region
        if self.mode is DescriptorMode.BLOCKS:
            unit = transfer_unit(self._layout, peer.layout)  # the unit the peer's list was made with
            if unit not in self._local_lists:
                descs = block_descs(self._layout, mine.base_addr, mine.device_id, unit)
                self._local_lists[unit] = self._agent.prep_local(descs, mine.mem_type)
            local_idx = unit_indices(self._layout, local_ids, unit)
            remote_idx = unit_indices(peer.layout, remote_ids, unit)
            xfer = self._agent.post(op, self._local_lists[unit], local_idx, remote_block_list, remote_idx)
            return NixlPost(xfer, (), num_merged_ranges(local_ids, remote_ids, self._layout, peer.layout))
        r = peer.region
        ranges = coalesce_blocks(local_ids, remote_ids, self._layout, peer.layout, self.max_descriptor_nbytes)
        local_list = self._agent.prep_local(
            range_descs(ranges.local_offsets, ranges.nbytes, mine.base_addr, mine.device_id), mine.mem_type
        )
        try:
            remote_list = self._agent.prep_remote(
                peer.agent_name, range_descs(ranges.remote_offsets, ranges.nbytes, r.base_addr, r.device_id), r.mem_type
            )
        except TransferError:
            self._agent.release_dlist(local_list)
            raise
        idx = np.arange(ranges.num_descriptors)
        try:
            xfer = self._agent.post(op, local_list, idx, remote_list, idx)
        except TransferError:
            self._agent.release_dlist(local_list)
            self._agent.release_dlist(remote_list)
            raise
        return NixlPost(xfer, (local_list, remote_list), ranges.num_descriptors)

    def release(self, post: NixlPost) -> None:
        """Release a transfer (cancelling it if still in flight) and its per-transfer lists."""
        self._agent.release(post.xfer)
        for dlist in post.dlists:
            self._agent.release_dlist(dlist)

    def close(self) -> None:
        """Forget the local lists; `NixlAgent.close` releases them."""
        self._local_lists.clear()
