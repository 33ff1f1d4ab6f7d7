"""`NixlPoster`: how one transfer of block pairs becomes a NIXL post, in a descriptor mode.

- "blocks" (default): one prepared list per side with a descriptor per unit (a block, or a page
  when either side's blocks are not one byte range: `descriptors.transfer_unit`), made once (the
  peer's by `PeerDirectory`, cached per peer; ours here, on first use, per unit), posted by unit
  index; NIXL merges entries adjacent on both sides.
- "ranges": `descriptors.coalesce_blocks` turns the pairing into byte ranges, split at
  `max_descriptor_nbytes`; both lists are prepared per transfer and released with it.

A peer whose block size or page format differs from ours is read through a `layout_plan.ReadPlan`
(`post_plan`, whatever the mode): a DIRECT plan's ranges land in our pages; a STAGED plan's land in
a staging buffer registered for that read, and `finish` runs the plan's gather into our pages once
NIXL reports the read done. The staging buffer is deregistered and dropped by `release`, so a read
quarantined in flight keeps it as long as it keeps its blocks.

docs/transfer.md has the measurements. Called by `KVEndpoint` on the owner's thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvbridge.errors import TransferError
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer import messages as m
from kvbridge.transfer.agent import NixlAgent, XferState
from kvbridge.transfer.descriptors import (
    Unit,
    block_descs,
    coalesce_blocks,
    num_merged_ranges,
    range_descs,
    region_descs,
    transfer_unit,
    unit_indices,
)
from kvbridge.transfer.handshake import PeerInfo
from kvbridge.transfer.layout_plan import PlanKind, ReadPlan
from kvbridge.transfer.options import DescriptorMode, TransferOp

if TYPE_CHECKING:
    import torch

    from kvbridge.transfer.agent import Registration
    from kvbridge.transfer.layout_gather import GatherIndex


class Staging(NamedTuple):
    """A STAGED read's landing buffer and the gather that empties it into our pages."""

    buffer: torch.Tensor  # [staging_nbytes] uint8 on our KV tensor's device, registered with NIXL
    registration: Registration
    gather: GatherIndex


class NixlPost(NamedTuple):
    xfer: object  # NIXL transfer handle, for NixlAgent.poll
    dlists: tuple  # per-transfer lists ("ranges" mode), released with the transfer
    num_descriptors: int  # ranges after NIXL's merging ("blocks"), or ranges posted
    plan: ReadPlan | None = None  # a translated read's plan (post_plan)
    staging: Staging | None = None  # a STAGED plan's buffer, until release
    more_xfers: tuple = ()  # a plan over several ranks of a TP peer: one more transfer per further rank

    @property
    def xfers(self) -> tuple:
        """Every NIXL transfer of this post; the read is done when all are, failed when any failed."""
        return (self.xfer, *self.more_xfers)


def poll_post(agent: NixlAgent, post: NixlPost) -> XferState:
    """One state for all of a post's transfers: IN_PROGRESS while any runs (a failed one's siblings
    may still be writing), then FAILED when any failed, else DONE."""
    states = [agent.poll(x) for x in post.xfers]
    if XferState.IN_PROGRESS in states:
        return XferState.IN_PROGRESS
    return XferState.DONE if all(s is XferState.DONE for s in states) else XferState.FAILED


class NixlPoster:
    def __init__(
        self,
        agent: NixlAgent,
        layout: KVCacheLayout,
        region: m.KVRegion,  # our registered KV tensor
        mode: DescriptorMode = DescriptorMode.BLOCKS,
        max_descriptor_nbytes: int | None = None,  # "ranges": split longer ranges
        device: torch.device | str = "cpu",  # where staging buffers live: our KV tensor's device
    ) -> None:
        self._agent, self._layout, self._region = agent, layout, region
        self._device = device
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
                descs = block_descs(self._layout, mine.base_addr, mine.device_id, unit, mine.layer_addrs)
                self._local_lists[unit] = self._agent.prep_local(descs, mine.mem_type)
            local_idx = unit_indices(self._layout, local_ids, unit)
            remote_idx = unit_indices(peer.layout, remote_ids, unit)
            xfer = self._agent.post(op, self._local_lists[unit], local_idx, remote_block_list, remote_idx)
            return NixlPost(xfer, (), num_merged_ranges(local_ids, remote_ids, self._layout, peer.layout))
        ranges = coalesce_blocks(local_ids, remote_ids, self._layout, peer.layout, self.max_descriptor_nbytes)
        local = region_descs(ranges.local_offsets, ranges.nbytes, mine)
        return self._post_ranges(op, local, mine.mem_type, ranges.remote_offsets, ranges.nbytes, peer.agent_name, peer.region)

    def post_plan(self, plan: ReadPlan, sources: list[tuple[str, m.KVRegion]]) -> NixlPost:
        """Post the reads of a plan from its prefill shards, `sources[i]` = (NIXL agent name, region) of
        the plan's source i: one NIXL transfer per source that has reads (a TP peer's ranks), all under
        one post. Raises TransferError when NIXL refuses (nothing is left prepared or registered then)."""
        import torch

        from kvbridge.transfer.layout_gather import GatherIndex

        reads, staging = plan.reads, None
        if plan.kind is PlanKind.DIRECT:
            local = region_descs(reads.local_offsets, reads.nbytes, self._region)
            mem_type = self._region.mem_type
        else:
            buffer = torch.empty(plan.staging_nbytes, dtype=torch.uint8, device=self._device)
            reg = self._agent.register_tensor(buffer)
            staging = Staging(buffer, reg, GatherIndex.of(plan.gather, buffer.device))
            local, mem_type = range_descs(reads.local_offsets, reads.nbytes, reg.base_addr, reg.device_id), reg.mem_type
        posts: list[NixlPost] = []
        try:
            for i in np.unique(reads.source).tolist():
                rows = reads.source == i
                agent_name, region = sources[i]
                posts.append(self._post_ranges(
                    TransferOp.READ, local[rows], mem_type, reads.remote_offsets[rows], reads.nbytes[rows], agent_name, region
                ))  # fmt: skip
        except TransferError:
            for post in posts:
                self.release(post)
            if staging is not None:
                self._agent.deregister(staging.registration)
            raise
        first = posts[0]
        return first._replace(
            dlists=tuple(d for p in posts for d in p.dlists), num_descriptors=sum(p.num_descriptors for p in posts),
            plan=plan, staging=staging, more_xfers=tuple(p.xfer for p in posts[1:]),
        )  # fmt: skip

    def _post_ranges(
        self, op, local_descs: np.ndarray, local_mem_type: str, remote_offsets, nbytes, agent_name: str, r: m.KVRegion
    ) -> NixlPost:
        """Prepare both per-transfer lists and post them entry for entry."""
        local_list = self._agent.prep_local(local_descs, local_mem_type)
        try:
            remote_list = self._agent.prep_remote(
                agent_name, region_descs(remote_offsets, nbytes, r), r.mem_type
            )
        except TransferError:
            self._agent.release_dlist(local_list)
            raise
        idx = np.arange(len(local_descs))
        try:
            xfer = self._agent.post(op, local_list, idx, remote_list, idx)
        except TransferError:
            self._agent.release_dlist(local_list)
            self._agent.release_dlist(remote_list)
            raise
        return NixlPost(xfer, (local_list, remote_list), len(local_descs))

    def finish(self, post: NixlPost, region_bytes: torch.Tensor) -> None:
        """After NIXL reports `post` done: a STAGED plan's gather from staging into our pages
        (`region_bytes`: our KV region as [region_nbytes] uint8). Nothing to do for other posts."""
        if post.staging is not None:
            from kvbridge.transfer.layout_gather import apply_gather

            apply_gather(post.staging.gather, post.staging.buffer, region_bytes)

    def release(self, post: NixlPost) -> None:
        """Release a transfer (cancelling it if still in flight), its per-transfer lists and its staging buffer."""
        for xfer in post.xfers:
            self._agent.release(xfer)
        for dlist in post.dlists:
            self._agent.release_dlist(dlist)
        if post.staging is not None:
            self._agent.deregister(post.staging.registration)

    def close(self) -> None:
        """Forget the local lists; `NixlAgent.close` releases them."""
        self._local_lists.clear()
