"""Paged attention over the block-major KV cache.

One step's attention is at most three padded SDPA calls per layer, however many requests it holds:
the decodes (one new token each), the prefills from position 0, and the chunks that continue a
context, each a batch of its own (`RequestBatch`). A batch pads each request's new tokens to
`num_queries` query slots and its keys to the table's `NB * block_size` slots, gathered through its
block table; a mask keeps query i of a request (position start + i) on keys <= start + i. Per
layer it (1) writes the step's new K/V into their slots, (2) attends. It reads only the strided
per-layer view `kv_cache[:, layer]` ([num_blocks, 2, block_size, num_kv_heads, head_dim]).

Everything per token (positions, slots, masks) is derived on the device from a few per-request
tensors with fixed-shape ops (`build_metadata`): nothing waits on the host, and a CUDA graph can
capture it (cuda_graphs.py). Grouped-query attention folds the query heads of one KV head into the
query axis, so K/V are never repeated. On a GPU with Triton, decode batches skip the gather:
`paged_decode.py` attends while it reads the blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvbridge.engine.fused_ops import has_triton


@dataclass(frozen=True)
class SeqSpan:
    """One request's tokens in the flattened batch: rows [offset, offset + num_new) of q/k/v."""

    offset: int
    start: int  # tokens of the request already in the cache (= position of its first new token)
    num_new: int
    block_ids: tuple[int, ...]

    @property
    def context_len(self) -> int:
        return self.start + self.num_new


class RequestBatch(NamedTuple):
    """Requests attended by one padded SDPA call: int64 tensors on the KV cache's device."""

    starts: torch.Tensor  # [B] position of each request's first new token
    num_new: torch.Tensor  # [B] new tokens, 1..num_queries
    offsets: torch.Tensor  # [B] row of the first new token in the step's flattened tokens
    block_table: torch.Tensor  # [B, NB] block ids covering each context, padded with any valid id
    num_queries: int  # query slots per request (>= max(num_new))
    # The query slots are exactly the step's tokens, in order (no padding slot, no other batch):
    # q and the output need no reordering.
    is_whole_step: bool
    # Every request starts at position 0: its keys are its new tokens, read from k/v as they are
    # rather than gathered back from the cache.
    is_from_start: bool
    # [B] (decode batches) the first row of each row's run, rows that read the same blocks (a
    # request's tokens as one-token rows), which `paged_decode` attends together. None: every row its own.
    first_rows: torch.Tensor | None = None


class PaddedBatch(NamedTuple):
    """What one SDPA call needs, derived from a `RequestBatch`."""

    query_rows: torch.Tensor | None  # [B * Q] row of q of each query slot (padding repeats the last); None: q as is
    block_table: torch.Tensor  # [B, NB]
    # [B, 1, group * Q, L] (or [B, 1, 1, L] when Q == 1) additive: 0 or -inf, q's dtype. None for a
    # batch from position 0 on a GPU: causal attention over its own tokens needs no mask.
    mask: torch.Tensor | None
    # [B, NB, bs, 1, 1] bool, True = slot past the context (zeroed after the gather); None: the keys
    # are the batch's new tokens (`RequestBatch.is_from_start`), L = Q.
    key_pad: torch.Tensor | None
    num_queries: int
    context_lens: torch.Tensor | None = None  # [B] keys of each request (decode batches: for paged_decode)
    # Decodes that `paged_decode` attends in place (on a GPU with Triton): no mask, no key_pad.
    is_paged_decode: bool = False
    first_rows: torch.Tensor | None = None  # [B] `RequestBatch.first_rows` for paged_decode, never None there


class AttentionMetadata(NamedTuple):
    """A step's attention inputs, on the device. T = tokens of the step."""

    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] block the token's K/V goes to
    slot_offsets: torch.Tensor  # [T] its slot in that block
    batches: tuple[PaddedBatch, ...]
    output_rows: torch.Tensor | None  # [T] row of each token in the batches' outputs, concatenated; None: as is


def build_metadata(
    requests: Sequence[RequestBatch], num_tokens: int, block_size: int, num_queries_per_kv: int, dtype: torch.dtype,
    head_dim: int,
) -> AttentionMetadata:
    """Positions, slots, masks and row maps of a step whose tokens are split into `requests`
    (`dtype`: the queries'). Fixed-shape tensor ops only: no host sync, capturable in a CUDA graph.
    """
    device = requests[0].starts.device
    # Row `num_tokens` of each per-token tensor collects the padding query slots and is dropped.
    per_token = torch.zeros(4, num_tokens + 1, dtype=torch.long, device=device)
    batches = []
    first_output_row = 0
    for req in requests:
        batch, targets, per_slot = _pad(req, num_tokens, block_size, num_queries_per_kv, dtype, head_dim, first_output_row)
        per_token.scatter_(1, targets.expand(4, -1), per_slot)
        batches.append(batch)
        first_output_row += targets.shape[1]
    positions, slot_blocks, slot_offsets, output_rows = per_token[:, :num_tokens]
    if len(requests) == 1 and requests[0].is_whole_step:
        batches[0] = batches[0]._replace(query_rows=None)
        output_rows = None
    return AttentionMetadata(positions, slot_blocks, slot_offsets, tuple(batches), output_rows)


def _pad(
    req: RequestBatch, num_tokens: int, block_size: int, group: int, dtype: torch.dtype, head_dim: int,
    first_output_row: int,
) -> tuple[PaddedBatch, torch.Tensor, torch.Tensor]:
    """(the padded batch, [1, B * Q] token row of each query slot or `num_tokens` for padding,
    [4, B * Q] position, slot block, slot offset and output row of each query slot)."""
    device = req.starts.device
    num_reqs = req.block_table.shape[0]
    num_keys = req.num_queries if req.is_from_start else req.block_table.shape[1] * block_size
    slot = torch.arange(req.num_queries, device=device)  # [Q]
    is_real = slot[None, :] < req.num_new[:, None]  # [B, Q]
    index = torch.minimum(slot[None, :], req.num_new[:, None] - 1)  # [B, Q]: padding repeats the last token
    query_pos = req.starts[:, None] + index  # [B, Q]
    query_rows = req.offsets[:, None] + index  # [B, Q]
    context_lens = req.starts + req.num_new if req.num_queries == 1 else None
    if req.num_queries == 1 and not req.is_from_start and device.type == "cuda" and decode_kernel(block_size, head_dim):
        first_rows = torch.arange(num_reqs, device=device) if req.first_rows is None else req.first_rows
        batch = PaddedBatch(query_rows.reshape(-1), req.block_table, None, None, 1, context_lens, True, first_rows)
    else:
        key_pos = torch.arange(num_keys, device=device)  # [L]
        # None: causal over the batch's own tokens, which flash attention does without a mask (`_attend_causal`).
        mask = None if req.is_from_start and device.type == "cuda" else _additive_mask(key_pos, query_pos, group, dtype)
        key_pad = None
        if not req.is_from_start:
            is_past_context = key_pos[None, :] >= (req.starts + req.num_new)[:, None]  # [B, L]
            key_pad = is_past_context.view(num_reqs, -1, block_size, 1, 1)
        batch = PaddedBatch(query_rows.reshape(-1), req.block_table, mask, key_pad, req.num_queries, context_lens)
    targets = torch.where(is_real, query_rows, num_tokens).reshape(1, -1)
    slot_blocks = req.block_table.gather(1, query_pos // block_size)  # [B, Q]
    output_rows = first_output_row + torch.arange(num_reqs * req.num_queries, device=device)
    slot_offsets = query_pos % block_size
    per_slot = torch.stack((query_pos.reshape(-1), slot_blocks.reshape(-1), slot_offsets.reshape(-1), output_rows))
    return batch, targets, per_slot


def _additive_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, group * Q, L] (or [B, 1, 1, L] when Q == 1): 0 where query i of a request may see key j
    (j <= its position), -inf elsewhere. Additive and built once per step: SDPA would convert a
    bool mask in every layer. Key 0 is always visible, so no row is all -inf."""
    num_reqs, num_queries = query_pos.shape
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
    if num_queries == 1:
        visible = visible[:, None]  # [B, 1, 1, L], broadcast over the folded query heads
    else:
        visible = visible[:, None].expand(-1, group, -1, -1).reshape(num_reqs, 1, group * num_queries, -1)
    return torch.full(visible.shape, float("-inf"), dtype=dtype, device=key_pos.device).masked_fill_(visible, 0.0)


def _gather(kv_half: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """kv_half [NB, bs, Hkv, D] (K or V of one layer) -> the batch's keys [B, Hkv, nb * bs, D]."""
    blocks = kv_half[batch.block_table]  # [B, nb, bs, Hkv, D], a copy
    # Slots past a context hold stale bytes (maybe NaN); a masked NaN still poisons SDPA. Zeroed
    # while the copy is contiguous: on the transposed view the fill runs several times slower.
    blocks.masked_fill_(batch.key_pad, 0.0)
    b, nb, bs, hkv, d = blocks.shape
    return blocks.view(b, nb * bs, hkv, d).transpose(1, 2)


def _new_keys(x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """x [T, Hkv, D] (the step's new K or V) -> the batch's keys [B, Hkv, Q, D] when they are its new tokens."""
    rows = x if batch.query_rows is None else x[batch.query_rows]
    return rows.view(-1, batch.num_queries, *x.shape[1:]).transpose(1, 2)


def _lone_decode(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's decode: qf [1, Hkv, group, D], k/v [1, Hkv, L, D] -> [1, Hkv, group, D].

    SDPA's kernels run one thread block per KV head over all L keys here, a handful for the whole
    GPU; two matmuls spread the keys over it (on an H200, 24 us instead of 91 us at L = 4,608).
    """
    scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale).add_(mask)  # [1, Hkv, group, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)


@functools.cache
def decode_kernel(block_size: int, head_dim: int) -> Callable[..., torch.Tensor] | None:
    """`paged_decode` (paged_decode.py) where Triton is installed, as with CUDA builds of torch,
    and runs this geometry."""
    if not has_triton():
        return None
    from kvbridge.engine.paged_decode import paged_decode, supports

    return paged_decode if supports(block_size, head_dim) else None


def _attend_causal(queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PaddedBatch, scale: float) -> torch.Tensor:
    """A batch whose keys are its own new tokens (every request from position 0), on a GPU: causal
    SDPA with grouped KV heads, which runs flash attention (no mask tensor, no folded queries).
    queries [B * Q, Hq, D] -> [B * Q, Hq, D]. A padded request's padding queries see its real keys
    and its repeated last token; their rows are dropped."""
    num_reqs, num_queries = batch.block_table.shape[0], batch.num_queries
    hq, d = queries.shape[1:]
    qs = queries.view(num_reqs, num_queries, hq, d).transpose(1, 2)  # [B, Hq, Q, D]
    out = F.scaled_dot_product_attention(
        qs, _new_keys(k, batch), _new_keys(v, batch), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(num_reqs * num_queries, hq, d)


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [B, n, Hq, D] -> [B, Hkv, group * n, D]: row g * n + i is query head kv * group + g at token i."""
    b, n, hq, d = q.shape
    group = hq // num_kv_heads
    return q.view(b, n, num_kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, group * n, d)


def _unfold_gqa(out: torch.Tensor, num_new: int) -> torch.Tensor:
    """Inverse of `_fold_gqa`: [B, Hkv, group * n, D] -> [B, n, Hq, D]."""
    b, hkv, gn, d = out.shape
    group = gn // num_new
    return out.view(b, hkv, group, num_new, d).permute(0, 3, 1, 2, 4).reshape(b, num_new, hkv * group, d)


class PagedAttention:
    """The attention callable of one step (or of one captured decode graph).

    Holds the KV cache only for the step's lifetime; the runner must not keep it around.
    """

    def __init__(self, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> None:
        self.kv_cache = kv_cache  # [NB, L, 2, bs, Hkv, D]
        self.metadata = metadata
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the step's new tokens -> [T, Hq, D]."""
        meta = self.metadata
        kv_layer = self.kv_cache[:, layer]  # [NB, 2, bs, Hkv, D], strided
        kv_layer[:, 0][meta.slot_blocks, meta.slot_offsets] = k.to(kv_layer.dtype)
        kv_layer[:, 1][meta.slot_blocks, meta.slot_offsets] = v.to(kv_layer.dtype)
        outs = [self._attend(kv_layer, q, k, v, batch) for batch in meta.batches]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if meta.output_rows is None else out[meta.output_rows]

    def _attend(
        self, kv_layer: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PaddedBatch
    ) -> torch.Tensor:
        # -> [B * Q, Hq, D], one row per query slot.
        num_reqs, num_queries = batch.block_table.shape[0], batch.num_queries
        queries = q if batch.query_rows is None else q[batch.query_rows]
        if batch.is_paged_decode:  # decodes on a GPU: attend while reading the blocks, no gathered copy
            kernel = decode_kernel(kv_layer.shape[2], q.shape[-1])
            return kernel(
                queries, kv_layer[:, 0], kv_layer[:, 1], batch.block_table, batch.context_lens, batch.first_rows, self.scale
            )
        if batch.mask is None:
            return _attend_causal(queries, k, v, batch, self.scale)
        qf = _fold_gqa(queries.view(num_reqs, num_queries, *q.shape[1:]), k.shape[1])
        if batch.key_pad is None:
            keys, values = _new_keys(k, batch), _new_keys(v, batch)  # [B, Hkv, Q, D]
        else:
            keys, values = _gather(kv_layer[:, 0], batch), _gather(kv_layer[:, 1], batch)  # [B, Hkv, L, D]
        if num_reqs == 1 and num_queries == 1:
            out = _lone_decode(qf, keys, values, batch.mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=batch.mask, scale=self.scale)
        return _unfold_gqa(out, num_queries).reshape(num_reqs * num_queries, *q.shape[1:])
