"""Decode steps replayed from CUDA graphs.

On a GPU an eager decode step costs mostly Python and kernel launches (dozens of launches per
layer), not arithmetic. `DecodeGraphs` captures the whole decode forward (attention metadata,
every layer, the final norm and the LM head) once per bucket and replays it: a step whose
requests all compute one token is padded to the next batch size of `BATCH_BUCKETS` and its block
table to a width of `table_width` (the next multiple of an eighth of the power of two below it, at
least `MIN_TABLE_BLOCKS`, at most the width of `max_model_len`; past the minimum, attention reads
at most 1/8 more keys than the step needs), its inputs are copied into the graph's static buffer, and the graph replays.
A bucket is captured the first time a step needs it (a warm-up run of that step on the capture
stream, then the capture), so only shapes that occur cost memory and start-up time.

Padding repeats the batch's last request (its token, position and block table): the padding rows
compute the same K/V as that request and write the same bytes into the same slot, and their logits
are dropped. Padded block-table entries are block 0, masked like any slot past a context.

Memory: the graphs share one private pool; `release()` frees them (the runner calls it before it
drops the KV cache). Warm-up and capture run on one side stream per device for the whole process,
so the cuBLAS workspace torch keeps per stream is allocated once per process, not per engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from kvbridge.engine.attention import RequestBatch
from kvbridge.engine.step_inputs import StepInputs, copy_to_device, num_table_blocks, pack_requests, unpack_requests

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_TABLE_BLOCKS = 8

# (input_ids [T], requests) -> logits [T, vocab] float32 of every row.
LogitsFn = Callable[[torch.Tensor, list[RequestBatch]], torch.Tensor]


class GraphKey(NamedTuple):
    num_reqs: int  # a batch bucket
    table_width: int  # blocks per block-table row


class DecodeGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [num_reqs] token ids, then `pack_requests` of the padded batch
    logits: torch.Tensor  # [num_reqs, vocab] float32, rewritten by every replay


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


def table_width(num_blocks: int) -> int:
    """The bucketed block-table width for contexts of up to `num_blocks` blocks: a multiple of
    1/8 of the power of two at or below it, at least MIN_TABLE_BLOCKS (8, 16, ..., 64, 72, 80, ...)."""
    step = max(MIN_TABLE_BLOCKS, 1 << max(num_blocks.bit_length() - 4, 0))
    return max(MIN_TABLE_BLOCKS, -(-num_blocks // step) * step)


class DecodeGraphs:
    """The captured decode graphs of one model runner. Called on the engine thread only."""

    def __init__(self, logits_fn: LogitsFn, block_size: int, max_model_len: int, device: torch.device) -> None:
        self._logits_fn: LogitsFn | None = logits_fn  # holds the model and the KV cache until release()
        self.block_size = block_size
        self.max_table_blocks = -(-max_model_len // block_size)
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[GraphKey, DecodeGraph] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def key_for(self, inputs: StepInputs) -> GraphKey | None:
        """The bucket that runs this step, or None when it must run eagerly (a prefill, a big batch)."""
        num_reqs = len(inputs.spans)
        if not inputs.is_decode_only or num_reqs > BATCH_BUCKETS[-1]:
            return None
        batch = next(b for b in BATCH_BUCKETS if b >= num_reqs)
        width = table_width(num_table_blocks(inputs.spans, self.block_size))
        return GraphKey(batch, min(width, self.max_table_blocks))

    def run(self, inputs: StepInputs, key: GraphKey) -> torch.Tensor:
        """Logits [len(inputs.sample_rows), vocab] of the step, from the graph of `key` (captured now
        when it is new). Writes the step's K/V like the eager forward."""
        spans, num_pad = inputs.spans, key.num_reqs - len(inputs.spans)
        padded = [*spans, *(replace(spans[-1], offset=row) for row in range(len(spans), key.num_reqs))]
        token_ids = [*inputs.token_ids, *(inputs.token_ids[-1:] * num_pad)]
        static, sample_rows = copy_to_device(
            [token_ids + pack_requests(padded, self.block_size, key.table_width), inputs.sample_rows], self.device
        )
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(static, key.num_reqs)
        graph.inputs.copy_(static)
        graph.graph.replay()
        return graph.logits[sample_rows]

    def _capture(self, inputs: torch.Tensor, num_reqs: int) -> DecodeGraph:
        static_inputs = inputs.clone()  # outside the graph's pool: it outlives every replay
        stream = _capture_stream(self.device.index if self.device.index is not None else torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._logits(static_inputs, num_reqs)  # warm-up: lazy per-stream state is created outside the capture
        graph = torch.cuda.CUDAGraph()
        # thread_local: a connector's own threads may use CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            logits = self._logits(static_inputs, num_reqs)
        return DecodeGraph(graph, static_inputs, logits)

    def _logits(self, inputs: torch.Tensor, num_reqs: int) -> torch.Tensor:
        if self._logits_fn is None:
            raise RuntimeError("DecodeGraphs used after release()")
        input_ids, packed = inputs.split((num_reqs, inputs.numel() - num_reqs))
        requests = [unpack_requests(packed, num_reqs, 1, is_whole_step=True, is_from_start=False)]
        return self._logits_fn(input_ids, requests)

    def release(self) -> None:
        """Free every graph, its pool and the references to the model and KV cache. Idempotent."""
        for graph in self._graphs.values():
            graph.graph.reset()
        self._graphs.clear()
        self._logits_fn = None

