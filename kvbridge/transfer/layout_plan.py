"""Plan a read of one prompt's KV from a prefill's layout into a decode's layout. Pure numpy.

The two sides of a P/D pair rarely lay KV out alike: tensor parallelism splits the KV heads
differently (a decode rank needs heads [h0, h1), held by one or several prefill ranks, or by
several when heads are replicated), block sizes differ (token t lives in block t // P on the
prefill and t // D on the decode), and page formats differ ("2NHD", "H2ND", "2HND", "H2ND-KT"
with each head's K transposed). What they must share is the model: layers, head_dim, the total
number of KV heads and the dtype.

Two plans, both listing pages and tokens, never elements, so planning costs O(blocks + tokens)
whatever head_dim and the page formats:

- DIRECT, for layouts that agree page for page (same block size and page format, whole blocks,
  each prefill rank's heads one byte range of both pages): read straight into the destination
  pages, runs adjacent on both sides merged (`page_reads.direct_reads`). Same layouts on both
  sides give exactly the runs of `descriptors.coalesce_blocks`.
- STAGED, for any layouts: read the source pages of the prompt's blocks, whole, into a staging
  buffer laid out like each prefill rank (runs of its blocks as one descriptor each,
  `page_reads.staged_reads`), then one gather pass on the reader's device
  (`layout_gather.apply_gather`: a few indexed copies between strided views, indices per token
  chunk, plan_gather.py) puts the tokens into the destination pages. TP 2 -> 1 gives one
  descriptor per run of source blocks per prefill rank.

`plan_read` takes DIRECT whenever it applies (no staging copy then), else STAGED. What cannot be
expressed raises `IncompatiblePeerError` naming both layouts (`check_same_model`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import ConfigError, IncompatiblePeerError, PlanTooLargeError
from kvbridge.layout import OPAQUE_FORMATS, KVCacheLayout
from kvbridge.transfer.kv_shard import HeadSpan, KVShard, head_spans
from kvbridge.transfer.page_reads import Reads, blocks_needed, direct_reads, staged_reads
from kvbridge.transfer.plan_gather import Gather, gather_pieces

# At most this many entries (pages listed and token chunks indexed) per plan: planning keeps ~10 int64
# arrays of this length (~1.3 GB at 2**24) and takes ~50 ms per million. Llama-8B shapes with 16-token
# blocks list 3 per token: ~5M tokens. Beyond, the read fails (PlanTooLargeError) rather than the engine.
MAX_PLAN_ENTRIES = 1 << 24


class PlanKind(enum.Enum):
    DIRECT = "direct"  # straight into the destination pages
    STAGED = "staged"  # into a staging buffer, then one gather pass into the pages


@dataclass(frozen=True)
class ReadPlan:
    """How to read `num_tokens` tokens of KV from the prefill shards into the decode shard."""

    kind: PlanKind
    reads: Reads
    num_tokens: int
    staging_nbytes: int = 0  # STAGED: bytes of the staging buffer; DIRECT: 0
    gather: Gather | None = None  # STAGED only
    num_direct_descriptors: int | None = None  # what DIRECT costs, for logs; None: the pages differ
    num_staged_descriptors: int = 0

    @property
    def num_descriptors(self) -> int:
        return len(self.reads.nbytes)

    @property
    def nbytes_read(self) -> int:
        return int(self.reads.nbytes.sum())

    def descriptors_per_source(self, num_sources: int) -> list[int]:
        return np.bincount(self.reads.source, minlength=num_sources).tolist()

    def summary(self) -> str:
        """One line for the log: the kind, descriptors (and the alternative's), bytes."""
        if self.kind is PlanKind.STAGED and self.num_direct_descriptors is None:
            other = "direct: none, the pages differ"
        elif self.kind is PlanKind.STAGED:
            other = f"direct: {self.num_direct_descriptors}"
        else:
            other = f"staged: {self.num_staged_descriptors}"
        return (
            f"{self.kind.value} plan: {self.num_descriptors} descriptors ({other}), "
            f"{self.nbytes_read} B read, {self.staging_nbytes} B staged, {self.num_tokens} tokens"
        )


# ---------------------------------------------------------------------------- refusals


def check_same_model(decode: KVShard, prefills: Sequence[KVShard]) -> None:
    """IncompatiblePeerError, naming both layouts, unless the shards are of one model (layers,
    head_dim, total KV heads, dtype) and the prefill shards hold every KV head the decode needs."""
    if not prefills:
        raise ConfigError("a read plan needs at least one prefill shard")
    for shard in prefills:
        a, b = decode.layout, shard.layout
        mine = (a.num_layers, a.head_dim, decode.total_kv_heads, a.dtype)
        theirs = (b.num_layers, b.head_dim, shard.total_kv_heads, b.dtype)
        if mine != theirs:
            raise IncompatiblePeerError(
                f"the prefill's KV ({shard.describe()}) and the decode's ({decode.describe()}) are not of one model: "
                "layers, head_dim, total KV heads and dtype must agree; serve the same checkpoint and kv dtype on both"
            )
    opaque = [s for s in (decode, *prefills) if s.layout.page_format in OPAQUE_FORMATS]
    if opaque:
        raise IncompatiblePeerError(
            f"the prefill's KV ({'; '.join(s.describe() for s in prefills)}) cannot be translated into the decode's "
            f"({decode.describe()}): {opaque[0].layout.page_format} pages move whole only, between engines of the same "
            "page format and block size; run both with the same vLLM attention kernels and block size"
        )
    missing = [h for h in range(decode.head_start, decode.head_end)
               if not any(s.head_start <= h < s.head_end for s in prefills)]  # fmt: skip
    if missing:
        held = "; ".join(s.describe() for s in prefills)
        raise IncompatiblePeerError(
            f"no prefill rank holds KV heads {missing} that the decode ({decode.describe()}) needs (prefill ranks: "
            f"{held}); give the decode every prefill rank's address"
        )


# ---------------------------------------------------------------------------- plans


def _check_size(decode: KVShard, prefills: Sequence[KVShard], spans: Sequence[HeadSpan], num_tokens: int) -> None:
    """PlanTooLargeError when the plan would list more than MAX_PLAN_ENTRIES pages and token chunks."""
    num_layers = decode.layout.num_layers
    entries = sum(num_layers * -(-num_tokens // prefills[s.source].layout.block_size) + num_tokens for s in spans)
    if entries > MAX_PLAN_ENTRIES:
        raise PlanTooLargeError(
            f"reading {num_tokens} tokens from {'; '.join(p.describe() for p in prefills)} into {decode.describe()} "
            f"lists {entries} pages and token chunks, more than {MAX_PLAN_ENTRIES}: the read fails (recomputed "
            "locally under policy recompute); split the prompt's KV into shorter reads"
        )


def _staged_gather(decode: KVShard, dst_ids: np.ndarray, prefills, spans, staged, num_tokens: int) -> Gather:
    pieces = []
    for span, shard in zip(spans, staged):
        heads = (span.head_start - prefills[span.source].head_start, span.head_start - decode.head_start, span.num_heads)
        pieces += gather_pieces(shard.layout, shard.offset, shard.token_blocks, decode.layout, dst_ids, num_tokens, heads)
    return Gather(decode.layout, True, tuple(pieces))


def plan_read(
    decode: KVShard,
    dst_block_ids,
    prefills: Sequence[KVShard],
    src_block_ids: Sequence,  # one id list per prefill shard
    num_tokens: int,
    *,
    kind: PlanKind | None = None,  # None: DIRECT where the layouts agree page for page, else STAGED
) -> ReadPlan:
    """The plan that reads tokens [0, num_tokens) of every KV head the decode shard holds from the
    prefill shards' blocks into the decode's blocks. Nothing outside those tokens and heads is written.

    Raises IncompatiblePeerError (see `check_same_model`), ValueError for too few block ids or for
    DIRECT between pages that differ, IndexError for an id outside its layout, PlanTooLargeError past
    MAX_PLAN_ENTRIES.
    """
    check_same_model(decode, prefills)
    if len(src_block_ids) != len(prefills):
        raise ValueError(f"{len(prefills)} prefill shards but {len(src_block_ids)} block id lists")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    src_ids = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in src_block_ids]
    spans = head_spans(decode, prefills)
    _check_size(decode, prefills, spans, num_tokens)
    blocks_needed(decode.layout, dst_ids, num_tokens)
    direct = direct_reads(decode, dst_ids, prefills, src_ids, spans, num_tokens)
    staged, staged_shards, staging_nbytes = staged_reads(prefills, src_ids, spans, num_tokens)
    n_direct = None if direct is None else len(direct.nbytes)
    kind = kind or (PlanKind.STAGED if direct is None else PlanKind.DIRECT)
    if kind is PlanKind.DIRECT:
        if direct is None:
            raise ValueError(
                f"a DIRECT read needs pages that agree page for page (block size, page format, whole blocks, heads "
                f"one range of a page): {'; '.join(p.describe() for p in prefills)} -> {decode.describe()}, {num_tokens} tokens"
            )
        return ReadPlan(kind, direct, num_tokens, num_direct_descriptors=n_direct, num_staged_descriptors=len(staged.nbytes))
    gather = _staged_gather(decode, dst_ids, prefills, spans, staged_shards, num_tokens)
    return ReadPlan(kind, staged, num_tokens, staging_nbytes, gather, n_direct, len(staged.nbytes))


def plan_engine_read(local: KVCacheLayout, remote: KVCacheLayout, local_block_ids, remote_block_ids) -> ReadPlan:
    """The plan of a P/D read between two whole engines (tensor parallel 1 on both sides): remote
    blocks `remote_block_ids` hold the prompt's first tokens, local blocks `local_block_ids` receive
    them. The tokens moved are those both lists have room for: min(len(local) * D, len(remote) * P)."""
    num_tokens = min(len(local_block_ids) * local.block_size, len(remote_block_ids) * remote.block_size)
    if num_tokens == 0:
        raise ValueError("a read plan needs at least one block on each side")
    return plan_read(KVShard(local), local_block_ids, [KVShard(remote)], [remote_block_ids], num_tokens)


def copy_gather(dst: KVShard, dst_block_ids, src: KVShard, src_block_ids, num_tokens: int) -> Gather:
    """The gather that copies tokens [0, num_tokens) of `dst`'s heads from `src`'s blocks into `dst`'s
    blocks, both in one process, when `dst_block_ids` are 0, 1, 2, ... of a layout of whole blocks
    (`layout_gather.apply_gather` with the source region as its source). What a reader uses to
    rebuild the prefill's blocks from its own pages, to digest them as the prefill did."""
    check_same_model(dst, [src])
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    src_ids = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    if num_tokens % dst.layout.block_size or not np.array_equal(dst_ids, np.arange(num_tokens // dst.layout.block_size)):
        raise ValueError("copy_gather writes whole blocks 0, 1, 2, ... of its destination")
    blocks_needed(src.layout, src_ids, num_tokens)
    heads = (0, dst.head_start - src.head_start, dst.layout.num_kv_heads)
    pieces = gather_pieces(dst.layout, 0, dst_ids, src.layout, src_ids, num_tokens, heads)
    return Gather(src.layout, False, tuple(pieces))
