"""The fused layer kernels (fused_ops.py) against their eager references, and a fused model against
the unfused one.

The kernels run on a GPU (`gpu` marker), or on the CPU through Triton's interpreter
(`TRITON_INTERPRET=1` with Triton installed; skipped otherwise).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.engine import fused_ops
from kvbridge.engine.model import RotaryEmbedding
from kvbridge.engine.presets import ModelArgs
from kvbridge.engine.weights import random_model

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton")),
]
DTYPES = ["float32", "bfloat16"]


def rand(*shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=getattr(torch, dtype))


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (float32 sums in another order)."""
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1000])  # a power of two, and two that are not
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_sum_then_norm(device, dtype, hidden, with_residual):
    x = rand(7, hidden, dtype=dtype, device=device, seed=hidden)
    residual = rand(7, hidden, dtype=dtype, device=device, seed=hidden + 1) if with_residual else None
    weight = rand(hidden, dtype=dtype, device=device, seed=hidden + 2)
    out, summed = fused_ops.add_rms_norm_kernel(x, residual, weight, 1e-6)
    expected_sum = x if residual is None else residual + x
    if device == "cuda" or dtype == "float32":  # the interpreter rounds float32 -> bfloat16 towards zero
        assert torch.equal(summed, expected_sum), "the residual stream is rounded exactly as the eager sum"
    assert_rounding_close(summed, expected_sum)
    assert_rounding_close(out, fused_ops.rms_norm_eager(expected_sum, weight, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_qk_rotates_only_queries_and_keys_in_place(device, dtype):
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 32, 5
    args = ModelArgs(
        vocab_size=16, hidden_size=128, num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=64, max_position=64,
    )  # fmt: skip
    positions = torch.tensor([0, 3, 9, 17, 40], device=device)
    cos, signed_sin = RotaryEmbedding(args, 64, device).lookup(positions)
    qkv = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=1)
    heads = qkv.view(num_tokens, -1, head_dim)
    expected = torch.cat((fused_ops.rotate_eager(heads[:, : num_heads + num_kv_heads], cos, signed_sin),
                          heads[:, num_heads + num_kv_heads :]), dim=1)  # fmt: skip
    fused_ops.rotate_qk_kernel_(qkv, num_heads + num_kv_heads, head_dim, cos, signed_sin)
    assert_rounding_close(heads, expected)
    assert torch.equal(heads[:, num_heads + num_kv_heads :], expected[:, num_heads + num_kv_heads :]), "values untouched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [64, 1500])  # one program per row, and two with a ragged end
def test_silu_and_mul_equals_eager(device, dtype, inner):
    gate_up = rand(3, 2 * inner, dtype=dtype, device=device, seed=inner)
    assert_rounding_close(fused_ops.silu_and_mul_kernel(gate_up), fused_ops.silu_and_mul_eager(gate_up))


TINY = ModelArgs(
    vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
    max_position=128, qkv_bias=True,
)  # fmt: skip


def test_fused_projections_equal_the_separate_ones_and_share_their_memory():
    fused, separate = random_model(TINY, seed=3), random_model(TINY, seed=3)
    fused.fuse_projections()
    attn = fused.model.layers[0].self_attn
    assert attn.qkv is not None
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.weight.untyped_storage().data_ptr()
    fused_bytes = sum(p.numel() for p in fused.parameters())
    assert fused_bytes == sum(p.numel() for p in separate.parameters()), "no weight is held twice"

    for model in (fused, separate):
        model.attach_rotary(32)
    ids = torch.arange(9) * 5 % TINY.vocab_size
    positions = torch.arange(9)

    def dense(layer, q, k, v):  # causal attention over the step's own tokens
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)

    torch.testing.assert_close(fused(ids, positions, dense), separate(ids, positions, dense), rtol=1e-5, atol=1e-5)
