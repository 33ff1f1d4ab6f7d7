"""Decode steps replayed from CUDA graphs.

On a GPU an eager decode step costs mostly Python and kernel launches (dozens of launches per
layer), not arithmetic. `DecodeGraphs` captures the whole decode forward (attention metadata,
every layer, the final norm and the LM head) once per batch size of `BATCH_BUCKETS` and replays it:
a step whose requests all compute one token is padded to the next bucket, its inputs are copied
into the graph's static buffers, and the graph replays. The graphs do not depend on the contexts:
the block table buffer is as wide as `max_model_len` (a step writes only the columns its longest
context needs; the kernel reads no column past a request's context) and the decode kernel's grid
depends on the batch size alone (paged_decode.py). So `capture` at start-up captures
every graph the engine will use, and no request waits for a capture.

A step of a few tokens that is not all decodes (a prefix hit's last block, a P/D decode's first
tokens, a short prompt beside decodes) replays a graph too: its tokens become one-token rows
(`step_inputs.one_token_rows`), token i of a request a decode at position start + i. A request's
rows form a run (`RequestBatch.first_rows`, a static input like the block table) that the decode
kernel attends together, reading the request's context once per tile of rows rather than once per
row; runs are data, not the grid, so one graph serves every grouping of its rows. Such a step
uses a graph only when one of its size is already captured: it runs eagerly rather than capture
on the request path.

Padding repeats the batch's last request (its token, position and block table, and it joins its
run): the padding rows compute the same K/V as that request and write the same bytes into the same
slot, and their logits are dropped.

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

from kvbridge.engine.attention import RequestBatch, SeqSpan
from kvbridge.engine.step_inputs import (
    StepInputs,
    copy_to_device,
    num_table_blocks,
    one_token_rows,
    pack_requests,
    run_first_rows,
    unpack_requests,
)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (input_ids [T], requests) -> logits [T, vocab] float32 of every row.
LogitsFn = Callable[[torch.Tensor, list[RequestBatch]], torch.Tensor]


# Per row of a graph's inputs: token id, first row of its run, then `pack_requests`'s start, num_new, offset.
NUM_ROW_INPUTS = 5


class DecodeGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    # [num_reqs] token ids, [num_reqs] `RequestBatch.first_rows`, then `pack_requests` of the padded
    # batch at the widest table
    inputs: torch.Tensor
    logits: torch.Tensor  # [num_reqs, vocab] float32, rewritten by every replay

    def table(self, num_reqs: int) -> torch.Tensor:
        """The block table part of `inputs`: [num_reqs, max table width], a view."""
        return self.inputs[NUM_ROW_INPUTS * num_reqs :].view(num_reqs, -1)


class PaddedRows(NamedTuple):
    """A step's tokens as the rows of a graph's batch."""

    token_ids: list[int]
    rows: list[SeqSpan]  # one token each
    first_rows: list[int]  # `RequestBatch.first_rows`


def pad_rows(inputs: StepInputs, bucket: int) -> PaddedRows:
    """The step's tokens as `bucket` one-token rows; the padding repeats the last row (token, position,
    blocks) and joins its run."""
    rows = one_token_rows(inputs.spans)
    num_pad = bucket - len(rows)
    first_rows = run_first_rows(inputs.spans)
    return PaddedRows(
        [*inputs.token_ids, *(inputs.token_ids[-1:] * num_pad)],
        [*rows, *(replace(rows[-1], offset=row) for row in range(len(rows), bucket))],
        [*first_rows, *(first_rows[-1:] * num_pad)],
    )


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


class DecodeGraphs:
    """The captured decode graphs of one model runner. Called on the engine thread only."""

    def __init__(self, logits_fn: LogitsFn, block_size: int, max_model_len: int, device: torch.device) -> None:
        self._logits_fn: LogitsFn | None = logits_fn  # holds the model and the KV cache until release()
        self.block_size = block_size
        self.max_table_blocks = -(-max_model_len // block_size)
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, DecodeGraph] = {}  # by batch bucket

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The batch size whose graph runs this step (one row per token), or None when it runs
        eagerly: more tokens than the largest bucket, or a step that is not all decodes whose bucket
        `capture` did not capture."""
        num_rows = len(inputs.token_ids)
        if num_rows > BATCH_BUCKETS[-1]:
            return None
        bucket = next(b for b in BATCH_BUCKETS if b >= num_rows)
        return bucket if inputs.is_decode_only or bucket in self._graphs else None

    def capture(self, max_num_seqs: int) -> None:
        """Capture every bucket a batch of up to `max_num_seqs` requests can use (at start-up, before
        any request: the warm-up runs write a token's K/V into slot 0 of block 0)."""
        for bucket in BATCH_BUCKETS:
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket)
            if bucket >= max_num_seqs:
                break

    def run(self, inputs: StepInputs, bucket: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(inputs.sample_rows), vocab] of the step, from the graph of `bucket` (captured
        now if `capture` did not: decodes only). Writes the step's K/V like the eager forward.

        `input_ids` ([len(inputs.spans)] on the device; decodes only) replaces `inputs.token_ids`: the
        tokens the step before sampled, copied device to device, so that nothing waits for them."""
        token_ids, padded, first_rows = pad_rows(inputs, bucket)
        num_rows = len(inputs.token_ids)
        width = num_table_blocks(padded, self.block_size)
        static, sample_rows = copy_to_device(
            [token_ids + first_rows + pack_requests(padded, self.block_size, width), inputs.sample_rows], self.device
        )
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(bucket)
        num_row_inputs = NUM_ROW_INPUTS * bucket
        graph.inputs[:num_row_inputs].copy_(static[:num_row_inputs])
        if input_ids is not None:
            graph.inputs[:num_rows].copy_(input_ids)
            graph.inputs[num_rows:bucket].copy_(input_ids[-1:].expand(bucket - num_rows))  # padding repeats the last
        # Columns past `width` keep an earlier step's ids: no request reads past its context.
        graph.table(bucket)[:, :width].copy_(static[num_row_inputs:].view(bucket, width))
        graph.graph.replay()
        return graph.logits[sample_rows]

    def _capture(self, num_reqs: int) -> DecodeGraph:
        # One token at position 0 per request, its K/V in block 0 (the padded table): any valid step.
        # Outside the graph's pool: the inputs outlive every replay.
        inputs = torch.zeros(
            NUM_ROW_INPUTS * num_reqs + num_reqs * self.max_table_blocks, dtype=torch.long, device=self.device
        )
        _, first_rows, _, num_new, offsets = inputs[: NUM_ROW_INPUTS * num_reqs].view(NUM_ROW_INPUTS, num_reqs)
        first_rows.copy_(torch.arange(num_reqs))  # every row its own run
        num_new.fill_(1)
        offsets.copy_(torch.arange(num_reqs))
        stream = _capture_stream(self.device.index if self.device.index is not None else torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._logits(inputs, num_reqs)  # warm-up: lazy per-stream state is created outside the capture
        graph = torch.cuda.CUDAGraph()
        # thread_local: a connector's own threads may use CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            logits = self._logits(inputs, num_reqs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return DecodeGraph(graph, inputs, logits)

    def _logits(self, inputs: torch.Tensor, num_reqs: int) -> torch.Tensor:
        if self._logits_fn is None:
            raise RuntimeError("DecodeGraphs used after release()")
        input_ids, first_rows, packed = inputs.split((num_reqs, num_reqs, inputs.numel() - 2 * num_reqs))
        batch = unpack_requests(packed, num_reqs, 1, is_whole_step=True, is_from_start=False)
        requests = [batch._replace(first_rows=first_rows)]
        return self._logits_fn(input_ids, requests)

    def release(self) -> None:
        """Free every graph, its pool and the references to the model and KV cache. Idempotent."""
        for graph in self._graphs.values():
            graph.graph.reset()
        self._graphs.clear()
        self._logits_fn = None

