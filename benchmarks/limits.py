"""The hardware's limits, measured in the same run as the figure they bound.

Every figure a benchmark reports is set against what the machine can do at best, never against a
loop written for the comparison:

- bytes that must be read (a decode step: the weights it multiplies plus the batch's KV) over the
  device's memory bandwidth, measured as a device-to-device copy of a buffer larger than any cache
  (`memory_bandwidth`: bytes read plus bytes written per second);
- floating-point work (a prefill) over the device's matmul rate, measured as large square matmuls
  in the figure's dtype (`matmul_rate`): their ratio is the model FLOPs utilization (MFU).

Both run on every thread torch uses (CPU) or the whole GPU, as a user's code would. A limit is the
best repetition (`bytes_per_s`, `flop_per_s`: what the hardware showed it can do; on a shared
machine a median would lower the bar), the median beside it.
"""

from __future__ import annotations

import statistics
import time

import torch

COPY_NBYTES_CPU = 1 << 30  # 1 GiB: far past any CPU cache
COPY_NBYTES_CUDA = 4 << 30  # 4 GiB: far past an H200's 50 MiB L2
MATMUL_N_CPU = 2048
MATMUL_N_CUDA = 8192


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device, reps: int, warmup: int = 2) -> tuple[float, float]:
    """(median, min) seconds of `fn()` over `reps` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def memory_bandwidth(device: torch.device | str, nbytes: int | None = None, reps: int = 7) -> dict:
    """Bytes moved (read + written) per second by one device-to-device copy of `nbytes`.

    A step that must read B bytes takes at least B / `bytes_per_s`: the copy is the fastest way
    this device streams memory that torch offers, and it streams through both read and write."""
    device = torch.device(device)
    nbytes = nbytes or (COPY_NBYTES_CUDA if device.type == "cuda" else COPY_NBYTES_CPU)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    median_s, min_s = _median_s(lambda: dst.copy_(src), device, reps)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"what": "device-to-device copy (torch copy_), read + written bytes per second",
            "copy_nbytes": nbytes, "bytes_per_s": 2 * nbytes / min_s, "bytes_per_s_median": 2 * nbytes / median_s,
            "reps": reps}


def matmul_rate(device: torch.device | str, dtype: torch.dtype, n: int | None = None, reps: int = 7) -> dict:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOP each), the device's dense compute rate."""
    device = torch.device(device)
    n = n or (MATMUL_N_CUDA if device.type == "cuda" else MATMUL_N_CPU)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    median_s, min_s = _median_s(lambda: a @ b, device, reps)
    del a, b
    return {"what": f"{n}x{n}x{n} matmul (torch @)", "dtype": str(dtype).removeprefix("torch."),
            "flop_per_s": 2 * n**3 / min_s, "flop_per_s_median": 2 * n**3 / median_s, "reps": reps}


def weight_nbytes_read_per_token(model: torch.nn.Module) -> int:
    """Bytes of the weights one forward pass of a token multiplies: every parameter, except the
    input embedding table when it is not the LM head (a token reads one row of it)."""
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def prefill_flops(model: torch.nn.Module, num_tokens: int, num_sequences: int = 1) -> int:
    """FLOPs of a causal prefill of `num_sequences` prompts of `num_tokens` tokens each: the matmuls
    of every linear layer for every token, attention scores and values over the causal half, and
    the LM head for each prompt's last token only (what an engine computes)."""
    args = model.args
    lm_head = model.lm_head.weight.numel()
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    causal_pairs = num_tokens * (num_tokens + 1) // 2
    attention = 2 * 2 * args.num_layers * args.num_heads * args.head_dim * causal_pairs  # QK^T and PV
    return num_sequences * (2 * linear * num_tokens + attention) + 2 * lm_head * num_sequences


def decode_step_nbytes(model: torch.nn.Module, kv_bytes_per_token: int, batch: int, context_len: int) -> int:
    """Bytes one decode step must read: the weights once, and each request's whole KV."""
    return weight_nbytes_read_per_token(model) + batch * context_len * kv_bytes_per_token


def host_load_rate(device: torch.device | str, nbytes: int = 1 << 30, reps: int = 7) -> dict:
    """Bytes per second of one copy from pinned host memory into `device` (on a CPU device: one
    memory copy), the fastest a host tier can hand KV back."""
    return _host_copy_rate(device, nbytes, reps, to_device=True)


def host_store_rate(device: torch.device | str, nbytes: int = 1 << 30, reps: int = 7) -> dict:
    """Bytes per second of one copy from `device` into pinned host memory (on a CPU device: one
    memory copy), the fastest a host tier can take KV in."""
    return _host_copy_rate(device, nbytes, reps, to_device=False)


def _host_copy_rate(device: torch.device | str, nbytes: int, reps: int, to_device: bool) -> dict:
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=is_cuda)
    on_device = torch.ones(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, on_device) if to_device else (on_device, host)
    median_s, min_s = _median_s(lambda: dst.copy_(src, non_blocking=is_cuda), device, reps)
    what = ("pinned host -> device copy" if to_device else "device -> pinned host copy") if is_cuda else "host memory copy (torch copy_)"
    return {"what": what, "copy_nbytes": nbytes, "bytes_per_s": nbytes / min_s, "bytes_per_s_median": nbytes / median_s,
            "reps": reps}  # fmt: skip
