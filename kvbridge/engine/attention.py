"""Paged attention over the block-major KV cache, and the dense reference it is tested against.

The model runner builds one `PagedAttention` per step from the scheduled requests. For every
layer it (1) writes the step's new K/V into their slots of the request's blocks, then (2) gathers
each request's cached tokens [0, start + n) through its block table and attends, causal within
the new tokens. It reads only the strided per-layer view `kv_cache[:, layer]`
([num_blocks, 2, block_size, num_kv_heads, head_dim]).

Decodes (one new token each) run as one padded batch; prefills (and chunked prefills) run one
request at a time with an explicit causal mask. Grouped-query attention folds the query heads of
one KV head into the query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def _slot_indices(spans: list[SeqSpan], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of every new token: two [T] int64 tensors."""
    blocks: list[int] = []
    offsets: list[int] = []
    for span in spans:
        for pos in range(span.start, span.context_len):
            blocks.append(span.block_ids[pos // block_size])
            offsets.append(pos % block_size)
    return (torch.tensor(blocks, dtype=torch.long, device=device), torch.tensor(offsets, dtype=torch.long, device=device))


def _block_table(spans: list[SeqSpan], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[B, num_blocks] block ids of each span, padded with block 0 (masked out by the caller)."""
    rows = [list(s.block_ids[:num_blocks]) + [0] * (num_blocks - min(num_blocks, len(s.block_ids))) for s in spans]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _gather_kv(kv_layer: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_layer [NB, 2, bs, Hkv, D], block_table [B, nb] -> K, V each [B, Hkv, nb * bs, D]."""
    blocks = kv_layer[block_table]  # [B, nb, 2, bs, Hkv, D]
    b, nb, _, bs, hkv, d = blocks.shape
    k = blocks[:, :, 0].reshape(b, nb * bs, hkv, d).transpose(1, 2)
    v = blocks[:, :, 1].reshape(b, nb * bs, hkv, d).transpose(1, 2)
    return k, v


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
    """The attention callable of one step. Built by the model runner, dropped after the step.

    Holds the KV cache only for the step's lifetime; the runner must not keep it around.
    """

    def __init__(self, kv_cache: torch.Tensor, spans: list[SeqSpan], block_size: int, scale: float) -> None:
        self.kv_cache = kv_cache  # [NB, L, 2, bs, Hkv, D]
        self.block_size = block_size
        self.scale = scale
        device = kv_cache.device
        self.slot_blocks, self.slot_offsets = _slot_indices(spans, block_size, device)  # [T], [T]
        self.decodes = [s for s in spans if s.num_new == 1]
        self.prefills = [s for s in spans if s.num_new > 1]
        self.decode_rows = torch.tensor([s.offset for s in self.decodes], dtype=torch.long, device=device)
        if self.decodes:
            max_ctx = max(s.context_len for s in self.decodes)
            num_ctx_blocks = -(-max_ctx // block_size)
            self.decode_table = _block_table(self.decodes, num_ctx_blocks, device)  # [Bd, nb]
            ctx_lens = torch.tensor([s.context_len for s in self.decodes], device=device)
            key_pos = torch.arange(num_ctx_blocks * block_size, device=device)
            is_key = key_pos[None, :] < ctx_lens[:, None]  # [Bd, nb * bs]
            self.decode_mask = is_key[:, None, None, :]  # [Bd, 1, 1, nb * bs]
            self.decode_pad = ~is_key[:, None, :, None]  # [Bd, 1, nb * bs, 1]
        self.prefill_tables = [_block_table([s], -(-s.context_len // block_size), device) for s in self.prefills]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the step's new tokens -> [T, Hq, D]."""
        kv_layer = self.kv_cache[:, layer]  # [NB, 2, bs, Hkv, D], strided
        kv_layer[:, 0][self.slot_blocks, self.slot_offsets] = k.to(kv_layer.dtype)
        kv_layer[:, 1][self.slot_blocks, self.slot_offsets] = v.to(kv_layer.dtype)
        out = torch.empty_like(q)
        num_kv_heads = k.shape[1]
        if self.decodes:
            out[self.decode_rows] = self._decode(kv_layer, q[self.decode_rows], num_kv_heads)
        for span, table in zip(self.prefills, self.prefill_tables):
            rows = slice(span.offset, span.offset + span.num_new)
            out[rows] = self._prefill(kv_layer, q[rows], span, table, num_kv_heads)
        return out

    def _decode(self, kv_layer: torch.Tensor, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        # q [Bd, Hq, D]: one new token per request; keys padded to the longest context, masked.
        k, v = _gather_kv(kv_layer, self.decode_table)  # [Bd, Hkv, Lmax, D]
        # Slots past a request's context hold stale bytes (maybe NaN); a masked NaN still poisons SDPA.
        k.masked_fill_(self.decode_pad, 0.0)  # in place: k and v are views of the gathered copy
        v.masked_fill_(self.decode_pad, 0.0)
        qf = _fold_gqa(q.unsqueeze(1), num_kv_heads)  # [Bd, Hkv, group, D]
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=self.decode_mask, scale=self.scale)
        return _unfold_gqa(out, 1).squeeze(1)  # [Bd, Hq, D]

    def _prefill(
        self, kv_layer: torch.Tensor, q: torch.Tensor, span: SeqSpan, table: torch.Tensor, num_kv_heads: int
    ) -> torch.Tensor:
        # q [n, Hq, D]; keys [0, start + n): query i (position start + i) sees keys j <= start + i.
        k, v = _gather_kv(kv_layer, table)
        k, v = k[:, :, : span.context_len], v[:, :, : span.context_len]  # [1, Hkv, L, D]
        qf = _fold_gqa(q.unsqueeze(0), num_kv_heads)  # [1, Hkv, group * n, D]
        group = q.shape[1] // num_kv_heads
        query_pos = torch.arange(span.num_new, device=q.device).repeat(group) + span.start  # [group * n]
        key_pos = torch.arange(span.context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [group * n, L]
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=self.scale)
        return _unfold_gqa(out, span.num_new).squeeze(0)  # [n, Hq, D]


class DenseCausalAttention:
    """Reference attention without a cache: each sequence attends causally over its own tokens.

    `seq_lens` splits the flattened batch into sequences that start at position 0. Written with
    plain matmul + softmax (float32 accumulate) so it shares no code with `PagedAttention`.
    """

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        outs = []
        for qs, ks, vs in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            ks = ks.repeat_interleave(group, dim=1)  # [n, Hq, D]
            vs = vs.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) / qs.shape[-1] ** 0.5
            n = qs.shape[0]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, vs.float()).to(q.dtype))
        return torch.cat(outs)
