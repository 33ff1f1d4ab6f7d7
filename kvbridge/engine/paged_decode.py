"""Decode attention that reads K/V in place from the paged cache (Triton, CUDA only).

The padded-SDPA path (attention.py) first gathers every decode request's keys and values out of
their blocks into contiguous tensors, then attends: at 4,096 tokens of context that copy is ~0.9 ms
of a 5.3 ms kv8b decode step on an H200 (docs/benchmarks.md). Here one kernel walks each request's
block table and attends as it reads (flash-decoding):

    grid (row, KV head, split): a tile's share of its blocks -> partial softmax state (max, sum, weighted V)
    grid (row, KV head, group): the tile's states -> the output row of one query head

Splitting the keys over programs keeps the GPU busy at batch 1 (8 KV heads would be 8 programs).
The number of splits depends only on the batch size and the GPU (`num_splits`): each program takes
an equal share of its tile's context, computed on the device from the context lengths. So the grid
never depends on the context or the block table's width, and one CUDA graph per batch size serves
every context (cuda_graphs.py). The query heads that share a KV head (GQA) are computed together,
so each K/V byte is read once per tile. Scores and the softmax state are float32.

A tile is the QUERY_TILE query rows of one tl.dot: a KV head's query heads of one row, or of up to
ROWS_PER_TILE consecutive rows of one run. A run is rows that read the same blocks: the tokens of one
request that a step computes as one-token rows (cuda_graphs.py; a host-tier hit's last 16 tokens),
row i seeing the keys [0, context_lens[i]). Each K/V byte is then read once per tile instead of once
per row (4 rows per tile at llama3-8b shapes, where one row fills 4 of the 16 query rows a tl.dot
needs), and the tile's rows pool their programs, so its share per program shrinks as well. Runs are
a device tensor (`first_rows`), not the grid: every grouping of a batch's rows replays the same
graph, and a row of its own (a plain decode) runs exactly the single-row tile it ran before.

Only decode batches (one query per row) come here, on CUDA, when Triton is installed;
`PagedAttention` uses the gather path otherwise. `TRITON_INTERPRET=1` runs the kernels on the CPU
(slowly), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Launch shape chosen by a sweep on an H200 (llama3-8b shapes, 4,096 keys, one layer, batch 32: keys per
# iteration 32/64/128 x warps 2/4/8 x stages 2/3/4 x 4/16 programs per SM): 140 us (3.8 TB/s, about 0.9 of a
# device copy) against 172 us for the previous 64 keys, 4 warps, 16 programs per SM.
KEYS_PER_ITER = 32  # keys one iteration loads and multiplies at once (tl.dot needs 16 at least)
NUM_WARPS = 2
NUM_STAGES = 3
MAX_SPLITS = 64  # programs per (row, KV head) at most
MIN_DOT = 16  # tl.dot needs 16 rows and 16 columns at least
# Query rows per tl.dot (a power of two, MIN_DOT at least): a KV head's query heads of as many rows of one
# run as fit (4 at llama3-8b's 4 query heads per KV head), or of one row, padded, when fewer fit.
QUERY_TILE = 16
# The running max before any key is -1e30 (a literal in the kernels: Triton reads no plain globals):
# finite, so a split whose keys are all past the context stays free of NaN (exp(-inf - -inf)).


@triton.jit
def _tile(first_rows_ptr, row, num_rows, ROWS_PER_TILE: tl.constexpr):
    """(first row, number of rows) of the tile that `row` belongs to: its run (`first_rows`) cut into
    tiles of ROWS_PER_TILE rows from the run's first row."""
    first = tl.load(first_rows_ptr + row).to(tl.int32)
    leader = first + (row - first) // ROWS_PER_TILE * ROWS_PER_TILE
    rows = leader + tl.arange(0, ROWS_PER_TILE)
    in_run = tl.load(first_rows_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int32) == first
    return leader, tl.sum(in_run.to(tl.int32), axis=0)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, first_rows_ptr, m_ptr, l_ptr, acc_ptr,
    scale, table_width, num_rows,
    s_qb, s_qh,  # q [B, Hq, D], last stride 1
    s_kb, s_ks, s_kh,  # K/V cache [NB, bs, Hkv, D] (same strides for V), last stride 1
    s_tb,  # block table [B, NB]
    num_splits,
    GROUP: tl.constexpr, HEADS_P2: tl.constexpr, TILE: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS_PER_ITER: tl.constexpr, IS_FP32: tl.constexpr,
):  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    leader, tile_rows = _tile(first_rows_ptr, row, num_rows, ROWS_PER_TILE)
    # The tile's rows pool their programs: row leader + i takes splits [i * num_splits, (i + 1) * num_splits)
    # of the tile's keys, which its leader's block table lists (the rows of a run read the same blocks).
    tile_splits = tile_rows * num_splits
    tile_split = (row - leader) * num_splits + split
    t = tl.arange(0, TILE)  # tile row t: query head kv_head * GROUP + t % HEADS_P2 of row leader + t // HEADS_P2
    head = t % HEADS_P2
    t_row = leader + t // HEADS_P2
    is_real = (head < GROUP) & (t // HEADS_P2 < tile_rows)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, KEYS_PER_ITER)
    q_rows = q_ptr + t_row[:, None] * s_qb + (kv_head * GROUP + head)[:, None] * s_qh + d[None, :]
    q = tl.load(q_rows, mask=is_real[:, None], other=0.0).to(tl.float32)  # [T, D], padding rows: 0
    lens = tl.load(lens_ptr + t_row, mask=is_real, other=0).to(tl.int32)  # [T]; padding rows see no key
    context_len = tl.max(lens, axis=0)

    m = tl.full([TILE], -1.0e30, tl.float32)
    l = tl.zeros([TILE], tl.float32)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    # This split's share of the context: whole iterations, the last split takes what is left (maybe nothing).
    share = tl.cdiv(tl.cdiv(context_len, tile_splits), KEYS_PER_ITER) * KEYS_PER_ITER
    first_key = tile_split * share
    end_key = tl.minimum(first_key + share, context_len)
    limit = tl.minimum(lens, end_key)  # [T]: each tile row sees the split's keys before its own context's end
    for it_start in range(first_key, end_key, KEYS_PER_ITER):
        key_pos = it_start + j  # [K]
        block_no = key_pos // BLOCK_SIZE
        key_ok = key_pos < end_key
        block = tl.load(table_ptr + leader * s_tb + block_no, mask=key_ok & (block_no < table_width), other=0)
        offsets = block[:, None] * s_kb + (key_pos % BLOCK_SIZE)[:, None] * s_ks + kv_head * s_kh + d[None, :]
        # float32 operands; for a 16-bit cache TF32 products are exact (its 10-bit mantissa holds
        # theirs), for a float32 cache IEEE keeps every bit.
        k = tl.load(k_ptr + offsets, mask=key_ok[:, None], other=0.0).to(tl.float32)  # [K, D]
        v = tl.load(v_ptr + offsets, mask=key_ok[:, None], other=0.0).to(tl.float32)
        if IS_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k), input_precision="tf32")
        scores = tl.where(key_pos[None, :] < limit[:, None], scores * scale, float("-inf"))  # [T, K]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if IS_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32")
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    state = (row * tl.num_programs(1) + kv_head) * num_splits + split  # [B, Hkv, S] flattened
    tl.store(m_ptr + state * TILE + t, m)
    tl.store(l_ptr + state * TILE + t, l)
    tl.store(acc_ptr + (state * TILE + t)[:, None] * HEAD_DIM + d[None, :], acc)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, first_rows_ptr, out_ptr,
    num_rows,
    s_ob, s_oh,  # out [B, Hq, D], last stride 1
    num_splits,
    GROUP: tl.constexpr, HEADS_P2: tl.constexpr, TILE: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr,
):  # fmt: skip
    # One program per query head: its tile row's states, num_splits per row of the tile, one [S, D] load per row.
    row, kv_head, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    leader, tile_rows = _tile(first_rows_ptr, row, num_rows, ROWS_PER_TILE)
    t = (row - leader) * HEADS_P2 + g
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    sp_ok = sp < num_splits
    m_all = -1.0e30
    l_all = 0.0
    acc_all = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tile_rows):
        states = (((leader + i) * tl.num_programs(1) + kv_head) * num_splits + sp) * TILE + t  # [S]
        m = tl.load(m_ptr + states, mask=sp_ok, other=-1.0e30)
        l = tl.load(l_ptr + states, mask=sp_ok, other=0.0)
        acc = tl.load(acc_ptr + states[:, None] * HEAD_DIM + d[None, :], mask=sp_ok[:, None], other=0.0)  # [S, D]
        m_new = tl.maximum(m_all, tl.max(m, axis=0))
        # [S]; 0 for splits without a key of this row once a real max is in (every row has a key).
        weight = tl.exp(m - m_new)
        alpha = tl.exp(m_all - m_new)
        acc_all = acc_all * alpha + tl.sum(acc * weight[:, None], axis=0)
        l_all = l_all * alpha + tl.sum(l * weight, axis=0)
        m_all = m_new
    out = acc_all / l_all
    tl.store(out_ptr + row * s_ob + (kv_head * GROUP + g) * s_oh + d, out.to(out_ptr.dtype.element_ty))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(block_size: int, head_dim: int) -> bool:
    """Whether the kernels can run this geometry: power-of-two head tiles of at least 16 (tl.dot)."""
    return block_size > 0 and _is_pow2(head_dim) and head_dim >= MIN_DOT


@functools.cache
def _num_programs_wanted(device: torch.device) -> int:
    """4 programs per streaming multiprocessor (the sweep above: 2 per SM was 10 % slower, 16 no faster)."""
    if device.type != "cuda":
        return 16  # Triton's interpreter on the CPU
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Programs per (row, KV head): enough for the whole GPU, whatever the contexts."""
    return max(1, min(MAX_SPLITS, -(-_num_programs_wanted(device) // (num_reqs * num_kv_heads))))


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_lens: torch.Tensor, first_rows: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """q [B, Hq, D] (one query per row) over the keys [0, context_lens[b]) of row b, read through
    `block_table` [B, NB] from k_cache/v_cache [num_blocks, block_size, Hkv, D] (strided views of
    one layer) -> [B, Hq, D] in q's dtype.

    first_rows [B]: the first row of each row's run, consecutive rows that read the same blocks
    (`first_rows[b] == b` for a row of its own). The rows of a run must list the same blocks over
    the run's longest context; their context lengths may differ (a request's tokens as rows)."""
    num_rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode needs K and V with the same strides and contiguous heads")
    if not supports(block_size, head_dim):
        raise ValueError(f"paged_decode cannot run blocks of {block_size} tokens with heads of {head_dim}")
    group = num_q_heads // num_kv_heads
    heads_p2 = triton.next_power_of_2(group)
    tile = max(QUERY_TILE, heads_p2)
    table_width = block_table.shape[1]
    splits = num_splits(num_rows, num_kv_heads, q.device)
    states = num_rows * num_kv_heads * splits * tile
    m = torch.empty(states, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(states, head_dim, dtype=torch.float32, device=q.device)
    tile_shape = {"HEADS_P2": heads_p2, "TILE": tile, "ROWS_PER_TILE": tile // heads_p2}
    _split_kernel[(num_rows, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, context_lens, first_rows, m, l, acc,
        scale, table_width, num_rows,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        splits,
        GROUP=group, **tile_shape, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        KEYS_PER_ITER=KEYS_PER_ITER, IS_FP32=q.dtype == torch.float32, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    out = torch.empty_like(q)
    _combine_kernel[(num_rows, num_kv_heads, group)](
        m, l, acc, first_rows, out,
        num_rows,
        out.stride(0), out.stride(1),
        splits,
        GROUP=group, **tile_shape, HEAD_DIM=head_dim, SPLITS_P2=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out
