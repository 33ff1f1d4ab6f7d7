"""vLLM's tensor-parallel workers as kvbridge's ranks: which heads a worker holds, and its group's byte exchange.

Under `--tensor-parallel-size N` vLLM runs N worker processes; each builds the adapter's worker
half (`worker_side.py`) over its own KV heads' cache, with a NIXL agent of its own. kvbridge's
per-rank contract (connectors/base.py, "tensor parallelism") needs three exchanges between them,
which kvbridge's engine makes over its own rank group (engine/tp_connector.py) and the adapter
makes over vLLM's TP group (its gloo CPU group, `get_tp_group().cpu_group`):

* at start-up, rank 0's engine incarnation to every rank (one engine, one incarnation: the
  handshake a reader checks and every lease name it), then every rank's `tp_rank_info` to rank 0,
  whose side channel answers the handshake for all ranks;
* in `get_finished` (the one call vLLM makes on every worker in every step, after `wait_for_save`)
  of a step whose metadata calls for it (`has_tp_step_report`: for the NixlConnector, a step
  granting leases), every rank's `tp_step_report` to rank 0 (`apply_tp_step_reports`: a lease is
  granted once every rank has digested its heads). Every worker binds the same metadata, so they
  all skip the other steps' exchange together.

What kvbridge's engine merges on rank 0 (a request is finished once every rank finished it; a
load error on any rank fails its request), vLLM merges itself: `KVOutputAggregator` counts each
request's finished_sending / finished_recving over all workers and unites invalid_block_ids.
The step's metadata needs no exchange either: vLLM hands the same metadata to every worker.

Every rank calls these in the same order (vLLM drives its workers in lockstep), so the
collectives pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.errors import KVBridgeError


@dataclass(frozen=True)
class TPRank:
    """This vLLM worker's place among the engine's tensor-parallel ranks, and the KV heads it holds."""

    rank: int
    size: int
    kv_head_start: int  # the first of the model's KV heads this worker's cache holds
    num_total_kv_heads: int

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @classmethod
    def of_worker(cls, vllm_config: Any) -> TPRank:
        """This process's rank (vLLM's TP group; it exists once vLLM built its worker) and its heads.

        vLLM shards KV heads evenly over the ranks, and replicates them when there are fewer heads
        than ranks (rank r then holds head r * heads // size)."""
        size = vllm_config.parallel_config.tensor_parallel_size
        total = vllm_config.model_config.get_total_num_kv_heads()
        if size == 1:
            return cls(0, 1, 0, total)
        from vllm.distributed.parallel_state import get_tp_group

        rank = get_tp_group().rank_in_group
        local = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
        start = rank * local if total >= size else rank * total // size
        return cls(rank, size, start, total)


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every TP rank's `data`, in rank order, over vLLM's TP CPU group (lengths, then padded bytes).

    A worker that has died makes the collective fail (gloo's timeout bounds the wait): TPExchangeError."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group
    world = dist.get_world_size(group)
    try:
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
        longest = max(int(n) for n in lengths)
        if longest == 0:
            return [b""] * world
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
    except RuntimeError as exc:
        raise TPExchangeError(
            f"KVBridgeConnector: exchange between vLLM's tensor-parallel workers failed ({exc}); another worker "
            "has stopped: restart the server"
        ) from exc
    return [t[: int(n)].numpy().tobytes() for t, n in zip(out, lengths, strict=True)]


class TPExchangeError(KVBridgeError, RuntimeError):
    """vLLM's tensor-parallel workers could not exchange what kvbridge's per-rank design needs."""
