"""`PreemptionWatch`: what the conformance kit's tap does when the engine preempts a request.

A preempted request's blocks are free the moment `schedule()` preempts it, and the forward of that
very step may overwrite them; a connector whose stores still read them must finish those stores in
`start_load_kv` (docs/connector-api.md, `build_connector_meta`). Once `start_load_kv` of that step
returned, the watch plays the forward that overwrites them: it writes a sentinel into every block
the request held that no other request holds with a cached prefix, and drops those blocks from the
prefix cache (so that nothing hits the sentinel; the request recomputes, or loads, its prefix). A
store still reading them stores the sentinel, and loading it back shows it (`tap._check_landed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvbridge.connectors.base import SchedulerOutput
    from kvbridge.engine.block_pool import BlockPool

PREEMPT_SENTINEL = -2222.0  # written into a preempted request's blocks once start_load_kv released them


class PreemptionWatch:
    """Fed every step's `SchedulerOutput` (`note_step`) and called once `start_load_kv` returned
    (`overwrite_released`). Block ids overwritten map to the request that was preempted."""

    def __init__(self, kv: torch.Tensor, pool: BlockPool) -> None:
        self.kv = kv  # [num_blocks, num_layers, *page_shape]
        self.pool = pool
        self._held: dict[str, list[int]] = {}  # request id -> its blocks at its last scheduled step
        self._to_overwrite: dict[str, list[int]] = {}  # preempted this step
        self.overwritten: dict[int, str] = {}  # block id -> the preempted request that held it
        self.preempted: list[str] = []  # request ids, in the order they were preempted

    def note_step(self, scheduler_output: SchedulerOutput) -> None:
        """Called with each step's output, before its metadata goes to the worker half."""
        for request_id in scheduler_output.preempted_req_ids:
            self._to_overwrite[request_id] = self._held.pop(request_id, [])
            self.preempted.append(request_id)
        for scheduled in scheduler_output.scheduled:
            self._held[scheduled.request.request_id] = list(scheduled.block_ids)
        for request_id in scheduler_output.finished_req_ids:
            self._held.pop(request_id, None)

    def overwrite_released(self) -> None:
        """After `start_load_kv` returned: the step's forward may now write these blocks."""
        for request_id, block_ids in self._to_overwrite.items():
            for block_id in block_ids:
                if self.pool.ref_count(block_id) and self.pool.block_hash(block_id) is not None:
                    continue  # another request shares this cached prefix block: its bytes stay valid
                self.pool.uncache_block(block_id)
                self.kv[block_id].fill_(PREEMPT_SENTINEL)
                self.overwritten[block_id] = request_id
        self._to_overwrite = {}

    def describe(self, got: torch.Tensor, where: str, loader: str) -> str | None:
        """The finding when a load brought back the sentinel, else None."""
        if not (got == PREEMPT_SENTINEL).any():
            return None
        return (f"request {loader!r} loaded ({where}) the sentinel the kit wrote into a preempted request's blocks "
                "once start_load_kv returned for the step that preempted it: a store still read them after "
                "they were free (finish a preempted request's stores in start_load_kv)")  # fmt: skip
