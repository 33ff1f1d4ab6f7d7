"""One tensor-parallel rank's process group: the model's all-reduces, and rank 0's step broadcast.

Rank 0 runs the scheduler and samples; every rank runs the model on its shard. Each step rank 0
broadcasts what the forward needs (`StepInputs`: the token ids, each request's span and block table)
as int64 tensors, a fixed header `[op, payload length]` then the payload (`encode_step`): a flat list
of integers, no pickle anywhere.

The groups are built from a `TCPStore` on loopback, as `ProcessGroup` objects held here rather than
torch.distributed's global default group, so an engine leaves no process-wide state behind and
engines can be built and shut down in a loop. On CPU one gloo group carries everything; on CUDA the
all-reduces run through NCCL on the rank's GPU, the control broadcast through gloo on the host
(the inputs start as host lists anyway).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from enum import IntEnum

import torch
import torch.distributed as dist

from kvbridge.engine.attention import SeqSpan
from kvbridge.engine.faults import EngineFaultError
from kvbridge.engine.step_inputs import StepInputs
from kvbridge.errors import TensorParallelError

STORE_HOST = "127.0.0.1"  # ranks of one engine share a host
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # one all-reduce or one step's broadcast
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next step: an idle server waits long
HEADER_LEN = 2  # [op, payload length]


class ControlOp(IntEnum):
    """What rank 0 tells the other ranks, in the header of each broadcast."""

    STEP = 1  # a payload of encode_step follows
    SHUTDOWN = 2  # release everything and exit
    KV_BEGIN = 3  # bytes follow: the step's connector metadata (tp_connector.py); start its loads
    KV_END = 4  # end the step's connector part; every rank then `gather_bytes` its report


BYTE_OPS = frozenset({ControlOp.KV_BEGIN})  # ops whose payload is bytes (uint8), not int64

def rank_device(device: str, rank: int) -> torch.device:
    """The device rank `rank` runs on: the CPU for every rank, or the GPU `rank` places after the
    configured one ("cuda" and "cuda:0" give ranks cuda:0, cuda:1, ...)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_devices(device: str, world_size: int) -> None:
    """Raise TensorParallelError unless every rank has its own GPU (on CUDA)."""
    base = torch.device(device)
    if base.type != "cuda":
        return
    first = base.index or 0
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + world_size > available:
        raise TensorParallelError(
            f"ModelConfig.tensor_parallel_size={world_size} on ModelConfig.device={device!r} needs GPUs "
            f"{first}..{first + world_size - 1}, one per rank; this machine has {available}"
        )


def encode_step(inputs: StepInputs) -> list[int]:
    """[num_tokens, num_spans, *token_ids, then per span: offset, start, num_new, num_blocks, *block_ids]."""
    payload = [len(inputs.token_ids), len(inputs.spans), *inputs.token_ids]
    for span in inputs.spans:
        payload += (span.offset, span.start, span.num_new, len(span.block_ids), *span.block_ids)
    return payload


def decode_step(payload: list[int]) -> StepInputs:
    """Inverse of `encode_step`. Sampling rows stay empty: only rank 0 samples."""
    num_tokens, num_spans = payload[0], payload[1]
    token_ids = payload[2 : 2 + num_tokens]
    spans = []
    at = 2 + num_tokens
    for _ in range(num_spans):
        offset, start, num_new, num_blocks = payload[at : at + 4]
        spans.append(SeqSpan(offset, start, num_new, tuple(payload[at + 4 : at + 4 + num_blocks])))
        at += 4 + num_blocks
    return StepInputs(token_ids, spans, [], [])


class TPGroup:
    """Rank `rank`'s membership in a group of `world_size` ranks rendezvousing through `store`.

    Every rank calls the same collectives in the same order: `all_reduce` inside the model,
    `min_int` once at start-up, rank 0's `send` matched by the others' `receive`. A collective that
    fails (a rank died) raises EngineFaultError: the ranks can no longer agree on anything.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, COLLECTIVE_TIMEOUT)
        self._compute = self._control
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self._compute = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (the row-parallel layers' AllReduce)."""
        self._wait(self._compute.allreduce([tensor]), "all-reduce")
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks that fit on every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._wait(self._control.allreduce([tensor], options), "start-up agreement")
        return int(tensor.item())

    def send(self, op: ControlOp, payload: Sequence[int] = ()) -> None:
        """Rank 0: tell every rank `op`, with `payload`."""
        header = torch.tensor([op, len(payload)], dtype=torch.int64)
        self._wait(self._control.broadcast(header, 0), "step broadcast")
        if payload:
            self._wait(self._control.broadcast(torch.tensor(payload, dtype=torch.int64), 0), "step broadcast")

    def send_bytes(self, op: ControlOp, data: bytes) -> None:
        """Rank 0: tell every rank `op` (one of BYTE_OPS), with `data` (msgspec-encoded; never pickle)."""
        header = torch.tensor([op, len(data)], dtype=torch.int64)
        self._wait(self._control.broadcast(header, 0), "step broadcast")
        if data:
            self._wait(self._control.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0), "step broadcast")

    def receive(self) -> tuple[ControlOp, list[int] | bytes]:
        """Ranks > 0: wait (as long as the server idles) for rank 0's next `send` (`send_bytes` for BYTE_OPS)."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._wait(self._control.broadcast(header, 0, IDLE_TIMEOUT), "waiting for rank 0")
        op, length = ControlOp(int(header[0])), int(header[1])
        payload = torch.empty(length, dtype=torch.uint8 if op in BYTE_OPS else torch.int64)
        if length:
            self._wait(self._control.broadcast(payload, 0), "step broadcast")
        return op, (payload.numpy().tobytes() if op in BYTE_OPS else payload.tolist())

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank: each rank's `data`, in rank order (every rank gets all; they are small)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self._control.allgather([lengths], [length]), "connector report")
        longest = max(int(n) for n in lengths)
        if longest == 0:
            return [b""] * self.world_size
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self._control.allgather([out], [mine]), "connector report")
        return [t[: int(n)].numpy().tobytes() for t, n in zip(out, lengths)]

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise EngineFaultError(
                f"tensor-parallel rank {self.rank}: {what} failed, another rank has stopped ({exc}); "
                "restart the engine"
            ) from exc

    def close(self) -> None:
        """Drop the groups (their sockets close with them). Idempotent."""
        for group in {id(g): g for g in (self._compute, self._control) if g is not None}.values():
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the peers may be gone already
                pass
        self._compute = self._control = None
