"""PagedAttention against DenseCausalAttention on random q/k/v, and where it writes K/V.

Every step runs through the batched path the model runner uses: decodes in one padded SDPA call,
prefills and chunked prefills in another, metadata derived on the device from per-request tensors.
"""

from __future__ import annotations

import random

import pytest
import torch
from dense_reference import DenseCausalAttention

from kvbridge.engine.attention import PagedAttention, SeqSpan, build_metadata
from kvbridge.engine.step_inputs import StepInputs, to_device

NUM_LAYERS = 2


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], poisoned so unwritten slots show.
    return torch.full((num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), float("nan"))


def paged(cache: torch.Tensor, spans: list[SeqSpan], num_queries_per_kv: int) -> PagedAttention:
    """The step's attention, built the way the model runner builds it."""
    block_size, head_dim = cache.shape[3], cache.shape[5]
    num_tokens = sum(s.num_new for s in spans)
    requests = to_device(StepInputs([0] * num_tokens, spans, [], []), block_size, cache.device).requests
    meta = build_metadata(requests, num_tokens, block_size, num_queries_per_kv, cache.dtype, head_dim)
    return PagedAttention(cache, meta, scale=head_dim**-0.5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_steps_match_dense(num_heads, num_kv_heads, block_size):
    """Three sequences advance by different chunk sizes each step; every step's output equals
    dense attention over the whole sequence so far (rows of the new tokens)."""
    seed = 1000 * num_heads + 10 * num_kv_heads + block_size
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    head_dim, layer = 8, 1
    lengths = [13, 1, 29]
    schedule = [[5, 1, 29], [7, 0, 0], [1, 0, 0]]  # new tokens per sequence per step (0: not scheduled)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_ids = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim)
    q_all = [torch.randn(n, num_heads, head_dim, generator=gen) for n in lengths]
    k_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    v_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    done = [0, 0, 0]
    for new_counts in schedule:
        spans, qs, ks, vs = [], [], [], []
        offset = 0
        for i, n in enumerate(new_counts):
            if n == 0:
                continue
            spans.append(SeqSpan(offset, done[i], n, tuple(block_ids[i])))
            rows = slice(done[i], done[i] + n)
            qs.append(q_all[i][rows]), ks.append(k_all[i][rows]), vs.append(v_all[i][rows])
            offset += n
        out = paged(cache, spans, num_heads // num_kv_heads)(layer, torch.cat(qs), torch.cat(ks), torch.cat(vs))
        for span, (i, n) in zip(spans, [(i, n) for i, n in enumerate(new_counts) if n]):
            end = done[i] + n
            dense = DenseCausalAttention([end])(layer, q_all[i][:end], k_all[i][:end], v_all[i][:end])
            got = out[span.offset : span.offset + n]
            torch.testing.assert_close(got, dense[done[i] : end], atol=1e-5, rtol=1e-5)
            done[i] = end
    assert torch.isnan(cache[:, 0]).all(), "writing layer 1 must not touch layer 0"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mixed_steps_match_dense(num_heads, num_kv_heads, block_size, seed):
    """Six sequences, two of them sharing the first sequence's full prefix blocks (a prefix hit:
    they start after it), advance by random chunks: each step mixes decodes, chunked prefills and
    whole prefills of different lengths. Every new token's output equals dense attention."""
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    head_dim, layer = 8, 0
    lengths = [rng.randrange(20, 60) for _ in range(6)]
    shared_blocks = lengths[0] // 2 // block_size  # full blocks of sequence 0's first half
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    block_ids = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    q_all = [torch.randn(n, num_heads, head_dim, generator=gen) for n in lengths]
    k_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    v_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lengths]
    done = [0] * 6
    for i in (4, 5):  # prefix hits on sequence 0's blocks, computed by its first step below
        block_ids[i][:shared_blocks] = block_ids[0][:shared_blocks]
        for t in (k_all, v_all):
            t[i][: shared_blocks * block_size] = t[0][: shared_blocks * block_size]
        done[i] = shared_blocks * block_size
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim)
    first = True
    while any(d < n for d, n in zip(done, lengths)):
        if first:  # sequence 0 computes the shared prefix before anyone reads it
            counts = [lengths[0] // 2 + 1, 0, 0, 0, 0, 0]
            first = False
        else:
            counts = [min(n - d, rng.choice((0, 1, 1, rng.randrange(1, 30)))) for d, n in zip(done, lengths)]
        live = [i for i, n in enumerate(counts) if n]
        if not live:
            continue
        spans, offset = [], 0
        for i in live:
            spans.append(SeqSpan(offset, done[i], counts[i], tuple(block_ids[i])))
            offset += counts[i]
        rows = [slice(done[i], done[i] + counts[i]) for i in live]
        q, k, v = (torch.cat([t[i][r] for i, r in zip(live, rows)]) for t in (q_all, k_all, v_all))
        out = paged(cache, spans, num_heads // num_kv_heads)(layer, q, k, v)
        for span, i in zip(spans, live):
            end = done[i] + counts[i]
            dense = DenseCausalAttention([end])(layer, q_all[i][:end], k_all[i][:end], v_all[i][:end])
            got = out[span.offset : span.offset + counts[i]]
            torch.testing.assert_close(got, dense[done[i] : end], atol=1e-5, rtol=1e-5, msg=f"sequence {i}")
            done[i] = end


def test_kv_lands_in_its_slot():
    block_size, head_dim = 4, 2
    cache = make_cache(8, block_size, 1, head_dim)
    k = torch.arange(6 * head_dim, dtype=torch.float32).view(6, 1, head_dim)
    v = -k
    span = SeqSpan(0, 3, 6, (6, 2, 5))  # tokens at positions 3..8
    paged(cache, [span], 1)(0, torch.zeros(6, 1, head_dim), k, v)
    for i, pos in enumerate(range(3, 9)):
        block, slot = span.block_ids[pos // block_size], pos % block_size
        assert torch.equal(cache[block, 0, 0, slot, 0], k[i, 0])
        assert torch.equal(cache[block, 0, 1, slot, 0], v[i, 0])
    assert torch.isnan(cache[6, 0, 0, :3]).all(), "positions before `start` are not written"
    assert torch.isnan(cache[[0, 1, 3, 4, 7]]).all(), "blocks outside the table are not written"


def test_dense_reference_is_causal():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 4, generator=gen) for _ in range(3))
    full = DenseCausalAttention([5])(0, q, k, v)
    prefix = DenseCausalAttention([3])(0, q[:3], k[:3], v[:3])
    torch.testing.assert_close(full[:3], prefix)
    assert not torch.allclose(full[3:], DenseCausalAttention([2])(0, q[3:], k[3:], v[3:]))


def test_a_step_splits_into_decodes_prompts_from_the_start_and_continuing_chunks():
    """A prompt's last chunk beside the next prompt's first: the two never share a padded call
    (the continuing chunk would pad the fresh prompt's queries onto the whole table, and the
    fresh prompt would pad the chunk to its length)."""
    spans = [SeqSpan(0, 40, 1, (0, 1, 2)), SeqSpan(1, 30, 3, (3, 4)), SeqSpan(4, 0, 20, (5, 6)), SeqSpan(24, 0, 1, (7,))]
    requests = to_device(StepInputs([0] * 25, spans, [], []), 16, torch.device("cpu")).requests
    assert [(r.num_new.tolist(), r.starts.tolist(), r.num_queries, r.is_from_start) for r in requests] == [
        ([1, 1], [40, 0], 1, False),
        ([20], [0], 20, True),
        ([3], [30], 3, False),
    ]
