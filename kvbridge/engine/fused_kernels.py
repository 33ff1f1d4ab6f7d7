"""Triton kernels of fused_ops.py (imported only where Triton is installed). One program per row
(per row and head for RoPE). Each rounds to the output dtype where the eager reference rounds."""

from __future__ import annotations

import triton
import triton.language as tl

SILU_BLOCK = 1024  # columns of silu(gate) * up one program computes


@triton.jit
def add_rms_norm_rows(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    s_x, s_r, s_out, s_sum,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * s_r + cols, mask=ok, other=0.0).to(tl.float32)).to(
            x_ptr.dtype.element_ty
        )  # the residual stream is rounded to the model dtype, as the eager sum is
        tl.store(sum_ptr + row * s_sum + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotate_heads(qkv_ptr, cos_ptr, sin_ptr, s_row, s_cos, s_sin, HEAD_DIM: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    base = qkv_ptr + row * s_row + head * HEAD_DIM
    x = tl.load(base + d).to(tl.float32)
    rolled = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)  # roll by D/2: the other half
    cos = tl.load(cos_ptr + row * s_cos + d)
    signed_sin = tl.load(sin_ptr + row * s_sin + d)
    tl.store(base + d, (x * cos + rolled * signed_sin).to(qkv_ptr.dtype.element_ty))


@triton.jit
def silu_mul_rows(gu_ptr, out_ptr, s_gu, s_out, inner, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inner
    gate = tl.load(gu_ptr + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * s_gu + inner + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)
