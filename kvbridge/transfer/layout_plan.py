"""Plan a read of one prompt's KV from a prefill's layout into a decode's layout. Pure numpy.

The two sides of a P/D pair rarely lay KV out alike: tensor parallelism splits the KV heads
differently (a decode rank needs heads [h0, h1), held by one or several prefill ranks, or by
several when heads are replicated), block sizes differ (token t lives in block t // P on the
prefill and t // D on the decode), and page formats differ ("2NHD", "H2ND", "2HND"). What they
must share is the model: layers, head_dim, the total number of KV heads and the dtype.

Every layout keeps head_dim innermost, so the unit both sides agree on is an *atom*: the
head_dim elements of one (layer, K|V, token, head), or more where every page format allows
(plan_atoms.py). The planner lists every atom the decode needs with its byte offset on both
sides, then chooses between two plans by descriptor count, which is what transfer speed depends on:

- DIRECT: read straight into the destination pages. A descriptor is a run of atoms adjacent
  on both sides; sorted by source offset, the maximal runs are the fewest descriptors possible.
- STAGED: read the source bytes into a staging buffer, then one gather pass on the reader's
  device (`layout_gather.apply_gather`) puts the atoms into the destination pages. A descriptor
  is a run adjacent on the source side only; runs may also swallow a gap of at most
  `max_gap_nbytes` when the gap lies inside the same or the next page (bytes of the blocks
  being read, never another request's): reading a few unneeded bytes costs far less than a
  descriptor (docs/transfer.md has the figures).

DIRECT wins ties, and wins whenever every direct read is at least a page (the layouts agree page
for page and differ only in placement or block ids): no staging copy then. Same layouts on both
sides give DIRECT with exactly the runs of `descriptors.coalesce_blocks`; TP 2 -> 1 gives STAGED with one descriptor per run of
source blocks per prefill rank. What cannot be expressed raises `IncompatiblePeerError` naming
both layouts (`check_same_model`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvbridge.block_runs import run_lengths, run_starts
from kvbridge.errors import ConfigError, IncompatiblePeerError
from kvbridge.layout import OPAQUE_FORMATS, KVCacheLayout
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.plan_atoms import Atoms, collect_atoms

DEFAULT_MAX_GAP_NBYTES = 256 * 1024  # a gap this size reads in ~1 us at 300 GB/s; a descriptor costs more


class PlanKind(enum.Enum):
    DIRECT = "direct"  # straight into the destination pages
    STAGED = "staged"  # into a staging buffer, then one gather pass into the pages


class Reads(NamedTuple):
    """Byte ranges to read: range i copies nbytes[i] bytes from `remote_offsets[i]` of prefill rank
    `source[i]`'s region to `local_offsets[i]` of the destination region (DIRECT) or of the staging
    buffer (STAGED)."""

    source: np.ndarray  # [N] int64, an index into the plan's sources
    remote_offsets: np.ndarray  # [N] int64
    local_offsets: np.ndarray  # [N] int64
    nbytes: np.ndarray  # [N] int64


class Gather(NamedTuple):
    """The staged pass: destination region row dst_rows[i] = staging row staging_rows[i], rows of
    `row_nbytes` bytes. `is_dense`: staging_rows is 0, 1, 2, ... (the staging buffer holds exactly
    the needed bytes, in order), so the pass reads the staging buffer as is."""

    row_nbytes: int
    staging_rows: np.ndarray  # [M] int64
    dst_rows: np.ndarray  # [M] int64
    is_dense: bool


@dataclass(frozen=True)
class ReadPlan:
    """How to read `num_tokens` tokens of KV from the prefill shards into the decode shard."""

    kind: PlanKind
    reads: Reads
    num_tokens: int
    staging_nbytes: int = 0  # STAGED: bytes of the staging buffer; DIRECT: 0
    gather: Gather | None = None  # STAGED only
    num_direct_descriptors: int = 0  # what the other choice would have cost, for logs
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
        other = self.num_staged_descriptors if self.kind is PlanKind.DIRECT else self.num_direct_descriptors
        return (
            f"{self.kind.value} plan: {self.num_descriptors} descriptors (the other kind: {other}), "
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


# ---------------------------------------------------------------------------- the two plans


def _direct_reads(atoms: Atoms) -> Reads:
    """Maximal runs of atoms adjacent on both sides (and of one source)."""
    is_start = np.zeros(len(atoms.src), dtype=bool)
    is_start[run_starts(atoms.src, atoms.dst, atoms.nbytes)] = True
    is_start[1:] |= atoms.source[1:] != atoms.source[:-1]  # a new source starts a run
    starts = np.flatnonzero(is_start)
    lengths = run_lengths(starts, len(atoms.src))
    return Reads(atoms.source[starts], atoms.src[starts], atoms.dst[starts], lengths * atoms.nbytes)


def _staged_reads(atoms: Atoms, page_nbytes: np.ndarray, max_gap_nbytes: int) -> tuple[Reads, Gather, int]:
    """Runs adjacent (or nearly: a small gap inside the same or the next page) on the source side,
    packed back to back in the staging buffer; and the gather from staging into the pages."""
    end = atoms.src + atoms.nbytes  # [A]
    gap = atoms.src[1:] - end[:-1]
    page, next_page = atoms.src_page[:-1], atoms.src_page[1:]
    same_or_next_page = (next_page == page) | (next_page == page + page_nbytes[:-1])
    joins = (atoms.source[1:] == atoms.source[:-1]) & (gap >= 0) & (
        (gap == 0) | ((gap <= max_gap_nbytes) & same_or_next_page)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))  # [R]
    last = np.append(starts[1:], len(atoms.src)) - 1  # [R] index of each run's last atom
    nbytes = end[last] - atoms.src[starts]  # [R]
    staging_start = np.cumsum(nbytes) - nbytes  # [R]
    run_of = np.repeat(np.arange(len(starts)), run_lengths(starts, len(atoms.src)))  # [A]
    staging = staging_start[run_of] + atoms.src - atoms.src[starts][run_of]  # [A] byte offset in staging
    reads = Reads(atoms.source[starts], atoms.src[starts], staging_start, nbytes)
    return reads, _gather(atoms, staging), int(nbytes.sum())


def _gather(atoms: Atoms, staging: np.ndarray) -> Gather:
    """Row indices for the pass: rows of the largest size that divides every offset (usually one atom)."""
    row = math.gcd(atoms.nbytes, int(np.gcd.reduce(staging % atoms.nbytes)), int(np.gcd.reduce(atoms.dst % atoms.nbytes)))
    per_atom = np.arange(atoms.nbytes // row, dtype=np.int64)  # [k]
    staging_rows = ((staging // row)[:, None] + per_atom).reshape(-1)  # [A * k]
    dst_rows = ((atoms.dst // row)[:, None] + per_atom).reshape(-1)
    is_dense = bool(np.array_equal(staging_rows, np.arange(len(staging_rows))))
    return Gather(row, staging_rows, dst_rows, is_dense)


def _moves_whole_pages(direct: Reads, decode: KVShard, prefills: Sequence[KVShard]) -> bool:
    """Whether every direct read is at least a page: the layouts agree page for page (they differ in
    placement or block ids only), which is what the block and page transfers have always read directly."""
    smallest_page = min(s.layout.page_nbytes for s in (decode, *prefills))
    return len(direct.nbytes) > 0 and int(direct.nbytes.min()) >= smallest_page


def plan_read(
    decode: KVShard,
    dst_block_ids,
    prefills: Sequence[KVShard],
    src_block_ids: Sequence,  # one id list per prefill shard
    num_tokens: int,
    *,
    kind: PlanKind | None = None,  # None: DIRECT for page-for-page layouts, else the one with fewer descriptors
    max_gap_nbytes: int = DEFAULT_MAX_GAP_NBYTES,
) -> ReadPlan:
    """The plan that reads tokens [0, num_tokens) of every KV head the decode shard holds from the
    prefill shards' blocks into the decode's blocks. Nothing outside those tokens' atoms is written.

    Raises IncompatiblePeerError (see `check_same_model`), ValueError for too few block ids and
    IndexError for an id outside its layout.
    """
    check_same_model(decode, prefills)
    if len(src_block_ids) != len(prefills):
        raise ValueError(f"{len(prefills)} prefill shards but {len(src_block_ids)} block id lists")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    src_ids = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in src_block_ids]
    atoms = collect_atoms(decode, dst_ids, prefills, src_ids, num_tokens)
    direct = _direct_reads(atoms)
    # prefill shards' pages may differ in size (their head counts): the gap rule takes each atom's
    page_nbytes = np.array([s.layout.page_nbytes for s in prefills], dtype=np.int64)[atoms.source]  # [A]
    staged, gather, staging_nbytes = _staged_reads(atoms, page_nbytes, max_gap_nbytes)
    n_direct, n_staged = len(direct.nbytes), len(staged.nbytes)
    if kind is None:
        kind = PlanKind.DIRECT if n_direct <= n_staged or _moves_whole_pages(direct, decode, prefills) else PlanKind.STAGED
    if kind is PlanKind.DIRECT:
        return ReadPlan(kind, direct, num_tokens, num_direct_descriptors=n_direct, num_staged_descriptors=n_staged)
    return ReadPlan(kind, staged, num_tokens, staging_nbytes, gather, n_direct, n_staged)


def plan_engine_read(local: KVCacheLayout, remote: KVCacheLayout, local_block_ids, remote_block_ids) -> ReadPlan:
    """The plan of a P/D read between two whole engines (tensor parallel 1 on both sides): remote
    blocks `remote_block_ids` hold the prompt's first tokens, local blocks `local_block_ids` receive
    them. The tokens moved are those both lists have room for: min(len(local) * D, len(remote) * P)."""
    num_tokens = min(len(local_block_ids) * local.block_size, len(remote_block_ids) * remote.block_size)
    if num_tokens == 0:
        raise ValueError("a read plan needs at least one block on each side")
    return plan_read(KVShard(local), local_block_ids, [KVShard(remote)], [remote_block_ids], num_tokens)


def copy_gather(
    dst: KVShard, dst_block_ids, src: KVShard, src_block_ids, num_tokens: int
) -> Gather:
    """The gather that copies tokens [0, num_tokens) from `src`'s blocks into `dst`'s blocks when both
    lie in one process: source region rows -> destination region rows (`layout_gather.apply_gather`
    with the source region as its "staging" buffer). What a reader uses to rebuild the prefill's
    blocks from its own pages, to digest them as the prefill did."""
    check_same_model(dst, [src])
    dst_ids = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
    src_ids = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
    atoms = collect_atoms(dst, dst_ids, [src], [src_ids], num_tokens)
    return _gather(atoms, atoms.src)
