"""The Triton decode kernel against a plain reference, and the attention path that uses it.

On a GPU (`gpu` marker). Without one, `TRITON_INTERPRET=1` with Triton installed runs the kernel
check on the CPU through Triton's interpreter (slow; skipped otherwise).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvbridge.engine import attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton")),
]


def reference(q, k_cache, v_cache, table, lens, scale):
    """Per request: its keys gathered through the table, float32 softmax attention."""
    num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = table[b, : -(-n // block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,lhd->hl", q[b].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", probs, v))
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_reqs, q_heads, kv_heads, head_dim, block_size, table_width, dtype",
    [
        (1, 32, 8, 128, 16, 256, "bfloat16"),  # kv8b at 4,096 tokens: 16 splits
        (3, 12, 4, 32, 16, 40, "float32"),  # a group of 3 (padded to 4), splits that end mid-table
        (2, 4, 4, 16, 8, 3, "float16"),  # no GQA, one split
        (5, 8, 1, 64, 16, 33, "float32"),  # one KV head for all, the last split holds one block
        (2, 4, 2, 16, 1, 40, "float32"),  # one-token blocks: 16 keys per iteration
    ],
)
def test_the_kernel_matches_the_reference(device, num_reqs, q_heads, kv_heads, head_dim, block_size, table_width, dtype):
    from kvbridge.engine.paged_decode import paged_decode

    rng = random.Random(num_reqs * 1000 + table_width)
    torch.manual_seed(num_reqs)
    dtype = getattr(torch, dtype)
    num_blocks = table_width * num_reqs + 7
    # [num_blocks, layers, 2, block_size, kv_heads, head_dim]: the engine's cache; layer 1's views
    cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, device=device).to(dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    table = torch.stack([torch.randperm(num_blocks, device=device)[:table_width] for _ in range(num_reqs)])
    lens = torch.tensor([table_width * block_size] + [rng.randint(1, table_width * block_size) for _ in range(num_reqs - 1)],
                        device=device)  # fmt: skip
    q = torch.randn(num_reqs, q_heads, head_dim, device=device).to(dtype)
    got = paged_decode(q, k_cache, v_cache, table, lens, torch.arange(num_reqs, device=device), head_dim**-0.5)
    want = reference(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and (got.float() - want).abs().max().item() < tolerance


def step_rows(spans, bucket, block_size, device):
    """What a graph replay of the step `spans` gives the kernel: (block table, context lens, first rows),
    one row per token, padded to `bucket` rows (cuda_graphs.pad_rows)."""
    from kvbridge.engine.cuda_graphs import pad_rows
    from kvbridge.engine.step_inputs import StepInputs, pack_requests, unpack_requests

    num_tokens = sum(s.num_new for s in spans)
    _, rows, first_rows = pad_rows(StepInputs([0] * num_tokens, spans, [], []), bucket)
    packed = torch.tensor(pack_requests(rows, block_size), device=device)
    batch = unpack_requests(packed, bucket, 1, is_whole_step=True, is_from_start=False)
    return batch.block_table, batch.starts + batch.num_new, torch.tensor(first_rows, device=device)


def spans_of(runs, block_size, num_blocks, rng):
    """SeqSpans of a step: (start, num_new) per request, distinct random blocks covering each context."""
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    spans, offset = [], 0
    for start, num_new in runs:
        num_table = -(-(start + num_new) // block_size)
        spans.append(attention.SeqSpan(offset, start, num_new, tuple(blocks[:num_table])))
        blocks, offset = blocks[num_table:], offset + num_new
    return spans


# (q heads, KV heads, head dim, block size, dtype, bucket, (start, new tokens) of each request)
STEPS = [
    # llama3-8b shapes: a host-tier hit's last 16 tokens, 4 rows per tile (4 query heads per KV head)
    (32, 8, 128, 16, "bfloat16", 16, [(1000, 16)]),
    # 3 query heads per KV head (4 rows per tile); a run across a block boundary, longer than a tile (7 > 4)
    (12, 4, 32, 16, "float32", 8, [(29, 7), (44, 1)]),
    # a 16-token request between decodes, contexts off the block boundaries; 2 padding rows join the last run
    (8, 2, 16, 16, "float16", 32, [(5, 1), (40, 16), (100, 1), (17, 12)]),
    # 8 query heads per KV head: 2 rows per tile; a run of 4 and its 3 padding rows: 4 tiles
    (8, 1, 64, 16, "float32", 8, [(3, 1), (70, 4)]),
    # no GQA: 16 rows per tile, a run of 20 takes two; two requests at one position; 8 padding rows
    (4, 4, 16, 8, "float32", 32, [(0, 20), (9, 1), (9, 1), (33, 2)]),
    # one-token blocks: every row of the run reads one block more than the row before
    (4, 2, 16, 1, "float32", 4, [(6, 3)]),
    # 16 query heads per KV head fill a tile: one row per tile, runs or not
    (16, 1, 32, 16, "float32", 4, [(20, 3)]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_size, dtype, bucket, runs", STEPS)
def test_the_rows_of_a_request_attended_together_match_the_reference(
    device, q_heads, kv_heads, head_dim, block_size, dtype, bucket, runs
):
    """Rows of one request (a run: same blocks, each row one key more) against the reference per row,
    and against the same rows attended one by one (no runs)."""
    from kvbridge.engine.paged_decode import paged_decode

    seed = len(runs) * 100 + bucket
    print("seed", seed)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = getattr(torch, dtype)
    num_blocks = sum(-(-(start + n) // block_size) for start, n in runs) + 5
    cache = torch.randn(num_blocks, 2, 2, block_size, kv_heads, head_dim, device=device).to(dtype)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    table, lens, first_rows = step_rows(spans_of(runs, block_size, num_blocks, rng), bucket, block_size, device)
    assert (first_rows[1:] == first_rows[:-1]).any(), "the step has a run"
    q = torch.randn(bucket, q_heads, head_dim, device=device).to(dtype)
    got = paged_decode(q, k_cache, v_cache, table, lens, first_rows, head_dim**-0.5)
    alone = paged_decode(q, k_cache, v_cache, table, lens, torch.arange(bucket, device=device), head_dim**-0.5)
    want = reference(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert (got.float() - want).abs().max().item() < tolerance
    assert (got.float() - alone.float()).abs().max().item() < tolerance


@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_shape_serves_every_grouping_of_its_rows(device):
    """What one captured graph does: the same buffers, refilled with steps whose rows group differently
    (a 16-token hit, decodes, a mix), through the same launch."""
    from kvbridge.engine.paged_decode import paged_decode

    rng = random.Random(5)
    print("seed", 5)
    torch.manual_seed(5)
    bucket, block_size, num_blocks, width = 16, 16, 300, 40
    cache = torch.randn(num_blocks, 2, 2, block_size, 2, 32, device=device)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    q = torch.randn(bucket, 8, 32, device=device)
    table = torch.zeros(bucket, width, dtype=torch.long, device=device)
    lens = torch.zeros(bucket, dtype=torch.long, device=device)
    first_rows = torch.zeros(bucket, dtype=torch.long, device=device)
    for runs in ([(600, 16)], [(i * 30 + 1, 1) for i in range(16)], [(47, 7), (20, 1), (0, 5)], [(17, 3)]):
        step_table, step_lens, step_first_rows = step_rows(spans_of(runs, block_size, num_blocks, rng), bucket,
                                                           block_size, device)  # fmt: skip
        table[:, : step_table.shape[1]].copy_(step_table)  # columns past the step's keep the last step's ids
        lens.copy_(step_lens)
        first_rows.copy_(step_first_rows)
        got = paged_decode(q, k_cache, v_cache, table, lens, first_rows, 32**-0.5)
        want = reference(q, k_cache, v_cache, table, lens, 32**-0.5)
        assert (got - want).abs().max().item() < 2e-5, runs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_through_the_kernel_equal_the_gather_path(monkeypatch, dtype):
    """The same decode steps, attention through paged_decode and through gather + SDPA."""
    from kvbridge.engine.step_inputs import StepInputs, to_device

    torch.manual_seed(0)
    dtype = getattr(torch, dtype)
    block_size, kv_heads, q_heads, head_dim = 16, 2, 8, 64
    cache = torch.randn(64, 2, 2, block_size, kv_heads, head_dim, device="cuda").to(dtype)
    spans = [attention.SeqSpan(i, start, 1, tuple(range(10 * i, 10 * i + 10))) for i, start in enumerate((5, 100, 159))]
    requests = to_device(StepInputs([0] * 3, spans, [], []), block_size, torch.device("cuda")).requests
    meta = attention.build_metadata(requests, 3, block_size, q_heads // kv_heads, dtype, head_dim)
    assert meta.batches[0].is_paged_decode
    q = torch.randn(3, q_heads, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(3, kv_heads, head_dim, device="cuda").to(dtype) for _ in range(2))
    through_kernel = attention.PagedAttention(cache.clone(), meta, head_dim**-0.5)(1, q, k, v)
    monkeypatch.setattr(attention, "decode_kernel", lambda block_size, head_dim: None)
    meta = attention.build_metadata(requests, 3, block_size, q_heads // kv_heads, dtype, head_dim)
    assert not meta.batches[0].is_paged_decode
    through_gather = attention.PagedAttention(cache.clone(), meta, head_dim**-0.5)(1, q, k, v)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    assert (through_kernel.float() - through_gather.float()).abs().max().item() < tolerance
