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
    got = paged_decode(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    want = reference(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and (got.float() - want).abs().max().item() < tolerance


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
