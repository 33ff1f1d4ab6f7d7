"""The elementwise work of a decoder layer fused into one kernel per operation (Triton, CUDA only).

Eager torch spends a decoder layer's non-matmul work on about twenty small kernels (RMSNorm alone:
cast up, square, mean, rsqrt, multiply, cast down, scale; RoPE: cast, two multiplies, roll, add,
cast). At batch 1 each runs in a few microseconds, so on an H200 they cost about as much as reading
the layer's weights; at 4,096 prefill tokens each is another pass over the activations. Here:

    add_rms_norm   residual += x, then RMSNorm of the sum           (one read of each, two writes)
    rotate_qk_     RoPE of the query and key heads, in place        (one pass over q and k)
    silu_and_mul   silu(gate) * up of the fused gate/up projection  (one pass)

Every kernel rounds where the eager code rounds (the residual sum to the model dtype, the
normalised value to the model dtype before the weight, silu's output before the product), so a
fused step differs from the eager one only in the order of float32 sums (the RMSNorm reduction).
The eager functions are the reference and the CPU path; `TRITON_INTERPRET=1` runs the kernels on
the CPU in tests.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_kernels(x: torch.Tensor) -> bool:
    """Whether `x`'s operations run as the fused kernels: on CUDA with Triton installed."""
    return x.is_cuda and has_triton()


# ---------------------------------------------------------------------------------- eager reference


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 like the reference implementation, then scale in the model dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate_eager(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated: rotate_half(x) * sin written as roll(x, D / 2) * signed_sin (sin with
    its first half negated); cos/signed_sin [T, 1, D] float32. Same dtype as x."""
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), signed_sin).to(x.dtype)


def silu_and_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------- dispatch


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) for x/residual [T, hidden]; no residual: (RMSNorm(x), x)."""
    if use_kernels(x):
        return add_rms_norm_kernel(x, residual, weight, eps)
    summed = x if residual is None else residual + x
    return rms_norm_eager(summed, weight, eps), summed


def rotate_qk_(qkv: torch.Tensor, num_rotated: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate the first `num_rotated` heads (queries, then keys) of every row of qkv [T, heads * D],
    in place. cos/signed_sin [T, 1, D] float32."""
    if use_kernels(qkv):
        rotate_qk_kernel_(qkv, num_rotated, head_dim, cos, signed_sin)
        return
    heads = qkv.view(qkv.shape[0], -1, head_dim)[:, :num_rotated]
    heads.copy_(rotate_eager(heads, cos, signed_sin))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate columns, then up) -> silu(gate) * up [T, I]."""
    if use_kernels(gate_up):
        return silu_and_mul_kernel(gate_up)
    return silu_and_mul_eager(gate_up)


# ---------------------------------------------------------------------------------- kernels
# Defined only where Triton is installed; the launchers import them on first use.


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def add_rms_norm_kernel(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from kvbridge.engine.fused_kernels import add_rms_norm_rows

    num_rows, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm needs rows with contiguous columns")
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    block = _next_pow2(hidden)
    add_rms_norm_rows[(num_rows,)](
        x, x if residual is None else residual, weight, out, summed,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), out.stride(0), summed.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, summed


def rotate_qk_kernel_(
    qkv: torch.Tensor, num_rotated: int, head_dim: int, cos: torch.Tensor, signed_sin: torch.Tensor
) -> None:
    from kvbridge.engine.fused_kernels import rotate_heads

    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rotate_qk_ needs contiguous heads")
    num_rows = qkv.shape[0]
    rotate_heads[(num_rows, num_rotated)](
        qkv, cos, signed_sin, qkv.stride(0), cos.stride(0), signed_sin.stride(0),
        HEAD_DIM=head_dim, num_warps=1,
    )  # fmt: skip


def silu_and_mul_kernel(gate_up: torch.Tensor) -> torch.Tensor:
    from kvbridge.engine.fused_kernels import SILU_BLOCK, silu_mul_rows

    num_rows, width = gate_up.shape
    inner = width // 2
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with contiguous columns")
    out = torch.empty(num_rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_rows[(num_rows, -(-inner // SILU_BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inner, BLOCK=SILU_BLOCK, num_warps=4
    )
    return out
