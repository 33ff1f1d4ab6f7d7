"""A step's inputs: gathered per request on the host, moved to the device in one copy.

The host side only lists each request's token ids, start, new-token count, row offset and block
table (Python work per request, none per token); everything per token is derived on the device by
`attention.build_metadata`. Decodes, prefills from position 0 and chunks that continue a context
form separate `RequestBatch`es, so a step is at most three padded attention calls per layer and
no request pads to another kind's length.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvbridge.engine.attention import RequestBatch, SeqSpan


class StepInputs(NamedTuple):
    """Host side of one step, in scheduled order."""

    token_ids: list[int]  # every scheduled request's new tokens, concatenated (T)
    spans: list[SeqSpan]
    sample_rows: list[int]  # row of the last new token of each request that samples this step
    sample_req_ids: list[str]

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new == 1 for s in self.spans)


class DeviceInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    sample_rows: torch.Tensor  # [S] int64
    requests: list[RequestBatch]


def one_token_rows(spans: Sequence[SeqSpan]) -> list[SeqSpan]:
    """The step's requests as rows of one token each: new token i of a request, at position start + i,
    attends to the keys up to its position, which is what a one-token decode at start + i does (a
    step writes every new token's K/V before any attention reads). So a step of a few tokens (a
    prefix hit's last block, a short prompt beside decodes) runs as a decode batch of its tokens."""
    return [SeqSpan(s.offset + i, s.start + i, 1, s.block_ids) for s in spans for i in range(s.num_new)]


def run_first_rows(spans: Sequence[SeqSpan]) -> list[int]:
    """For each of `one_token_rows(spans)`, the row of its request's first token: a request's rows
    read the same blocks, so `RequestBatch.first_rows` lets the decode kernel attend them together."""
    firsts = itertools.accumulate((s.num_new for s in spans), initial=0)
    return [first for s, first in zip(spans, firsts) for _ in range(s.num_new)]


def num_table_blocks(spans: Sequence[SeqSpan], block_size: int) -> int:
    """Block-table width that covers the longest context of `spans`."""
    return max(-(-s.context_len // block_size) for s in spans)


def pack_requests(spans: Sequence[SeqSpan], block_size: int, table_width: int | None = None) -> list[int]:
    """starts, num_new, offsets (B each), then the [B, table_width] block table padded with block 0."""
    width = num_table_blocks(spans, block_size) if table_width is None else table_width
    table = itertools.chain.from_iterable(
        (*s.block_ids[:width], *(0,) * (width - min(width, len(s.block_ids)))) for s in spans
    )
    return [*(s.start for s in spans), *(s.num_new for s in spans), *(s.offset for s in spans), *table]


def unpack_requests(
    packed: torch.Tensor, num_reqs: int, num_queries: int, is_whole_step: bool, is_from_start: bool
) -> RequestBatch:
    """The `RequestBatch` whose `pack_requests` output is the 1-D tensor `packed` (views, no copy)."""
    starts, num_new, offsets, table = packed.split((num_reqs, num_reqs, num_reqs, packed.numel() - 3 * num_reqs))
    return RequestBatch(starts, num_new, offsets, table.view(num_reqs, -1), num_queries, is_whole_step, is_from_start)


def copy_to_device(segments: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """One int64 tensor per segment on `device`, through a single host -> device copy that does not
    wait for the device (from pinned memory, which torch reuses only once the copy has completed)."""
    host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(segments), dtype=np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(s) for s in segments]))


def split_decodes(spans: Sequence[SeqSpan]) -> list[list[SeqSpan]]:
    """The non-empty groups among (decodes, prefills from position 0, chunks that continue a
    context): each is one padded attention call. Prefills from position 0 attend only their own
    tokens (causal flash attention on a GPU); were a continuing chunk of a few tokens among them,
    every one of them would be padded to a masked call over the whole table (a prompt's last chunk
    beside the next prompt's first: 1 real query padded to 4,096, over 4,096 gathered keys)."""
    decodes = [s for s in spans if s.num_new == 1]
    from_start = [s for s in spans if s.num_new > 1 and s.start == 0]
    continuing = [s for s in spans if s.num_new > 1 and s.start > 0]
    return [group for group in (decodes, from_start, continuing) if group]


def to_device(inputs: StepInputs, block_size: int, device: torch.device) -> DeviceInputs:
    groups = split_decodes(inputs.spans)
    segments = [inputs.token_ids, inputs.sample_rows, *(pack_requests(g, block_size) for g in groups)]
    input_ids, sample_rows, *packed = copy_to_device(segments, device)
    requests = []
    for group, group_packed in zip(groups, packed):
        num_queries = max(s.num_new for s in group)
        is_whole_step = len(groups) == 1 and all(s.num_new == num_queries for s in group)
        is_from_start = all(s.start == 0 for s in group)
        requests.append(unpack_requests(group_packed, len(group), num_queries, is_whole_step, is_from_start))
    return DeviceInputs(input_ids, sample_rows, requests)
