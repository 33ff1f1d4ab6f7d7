"""Reference engine throughput: prefill and decode tokens/s, against a dense non-paged baseline.

    python benchmarks/engine_throughput.py --json                       # tiny, float32, CPU
    python benchmarks/engine_throughput.py --preset small --device cuda --dtype bfloat16 --batch 32 --json
    python benchmarks/engine_throughput.py --preset small --device cuda --dtype bfloat16 --enforce-eager --json

The figure: `EngineCore` (scheduler + paged KV cache + sampling, prefix caching off) runs `batch`
prompts of `prompt_len` tokens, then decodes `decode_len` tokens each. Prefill time runs from
adding the requests until every request has its first token; decode time from there to the end.

The baseline, measured in the same run on the same weights: the same batch through the same model
with a contiguous (non-paged) per-layer KV cache, no scheduler and greedy argmax — what the model
costs without the engine's bookkeeping and paging. On CUDA the engine replays decode steps from CUDA
graphs unless `--enforce-eager`; the baseline always runs eagerly. `ratio` = engine tokens/s / baseline tokens/s.
Each figure: warm-up, then the median and min over `--reps` repetitions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from common import machine_info, versions

from kvbridge.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvbridge.engine.core import EngineCore
from kvbridge.engine.sampling_params import SamplingParams


class ContiguousKVAttention:
    """Baseline attention: per layer one [B, Hkv, max_len, D] K and V, same-length sequences."""

    def __init__(self, batch: int, max_len: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, 2, batch, num_kv_heads, max_len, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.pos, self.num_new = batch, 0, 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.num_new  # q [b * n, Hq, D], k/v [b * n, Hkv, D]
        q = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [b, Hq, n, D]
        cache = self.kv[layer]
        cache[0, :, :, self.pos : self.pos + n] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        cache[1, :, :, self.pos : self.pos + n] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        group = q.shape[1] // cache.shape[2]
        keys = cache[0, :, :, : self.pos + n].repeat_interleave(group, dim=1)  # [b, Hq, ctx, D]
        values = cache[1, :, :, : self.pos + n].repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=n > 1)
        return out.transpose(1, 2).reshape(b * n, *out.shape[1:2], out.shape[-1])


@torch.inference_mode()
def run_baseline(model, prompts: list[list[int]], decode_len: int, layout, device) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the dense, non-paged batch."""
    batch, prompt_len = len(prompts), len(prompts[0])
    attn = ContiguousKVAttention(batch, prompt_len + decode_len, layout.num_layers, layout.num_kv_heads,
                                 layout.head_dim, getattr(torch, layout.dtype), device)
    ids = torch.tensor(prompts, dtype=torch.long, device=device).view(-1)
    positions = torch.arange(prompt_len, device=device).repeat(batch)
    sync(device)
    start = time.perf_counter()
    attn.num_new = prompt_len
    hidden = model(ids, positions, attn)
    last = hidden.view(batch, prompt_len, -1)[:, -1]
    tokens = model.compute_logits(last).argmax(-1)
    sync(device)
    prefill_s = time.perf_counter() - start
    attn.pos, attn.num_new = prompt_len, 1
    start = time.perf_counter()
    for step in range(decode_len):
        positions = torch.full((batch,), prompt_len + step, device=device)
        tokens = model.compute_logits(model(tokens, positions, attn)).argmax(-1)
        tokens.tolist()  # the engine hands token ids to Python every step too
        attn.pos += 1
    sync(device)
    return prefill_s, time.perf_counter() - start


def run_engine(engine: EngineCore, prompts: list[list[int]], decode_len: int, rep: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the batch through EngineCore."""
    params = SamplingParams(max_tokens=decode_len + 1, temperature=0.0, ignore_eos=True)
    ids = [f"rep{rep}-{i}" for i in range(len(prompts))]
    device = engine.runner.device
    sync(device)
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step())
    sync(device)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync(device)
    return prefill_s, time.perf_counter() - start


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def summarize(times: list[float], num_tokens: int) -> dict:
    median, best = statistics.median(times), min(times)
    return {"tokens_per_s": num_tokens / median, "tokens_per_s_best": num_tokens / best,
            "median_s": median, "min_s": best, "num_tokens": num_tokens, "reps": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: decode eagerly, without CUDA graphs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    num_tokens = args.batch * (args.prompt_len + args.decode_len + 1)
    config = EngineConfig(
        model=ModelConfig(args.preset, args.dtype, args.device, seed=args.seed, enforce_eager=args.enforce_eager),
        cache=CacheConfig(block_size=args.block_size, num_blocks=-(-num_tokens // args.block_size) + 1,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len),
    )
    engine = EngineCore(config)
    try:
        engine_times, baseline_times = [], []
        for rep in range(args.reps + 1):  # rep 0 warms up
            prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.batch)]
            engine_run = run_engine(engine, prompts, args.decode_len, rep)
            baseline_run = run_baseline(engine.runner.model, prompts, args.decode_len, engine.layout, args.device)
            if rep:
                engine_times.append(engine_run)
                baseline_times.append(baseline_run)
        model_id, num_graphs = engine.model_id, engine.runner.num_cuda_graphs
    finally:
        engine.shutdown()

    prefill_tokens, decode_tokens = args.batch * args.prompt_len, args.batch * args.decode_len
    prefill = summarize([t[0] for t in engine_times], prefill_tokens)
    decode = summarize([t[1] for t in engine_times], decode_tokens)
    base_prefill = summarize([t[0] for t in baseline_times], prefill_tokens)
    base_decode = summarize([t[1] for t in baseline_times], decode_tokens)
    report = {
        "benchmark": "engine_throughput",
        "prefill_tokens_per_s": prefill["tokens_per_s"],
        "decode_tokens_per_s": decode["tokens_per_s"],
        "baseline": "same weights, contiguous non-paged KV, no scheduler, greedy argmax",
        "baseline_prefill_tokens_per_s": base_prefill["tokens_per_s"],
        "baseline_decode_tokens_per_s": base_decode["tokens_per_s"],
        "prefill_ratio": prefill["tokens_per_s"] / base_prefill["tokens_per_s"],
        "decode_ratio": decode["tokens_per_s"] / base_decode["tokens_per_s"],
        "engine": {"prefill": prefill, "decode": decode},
        "dense": {"prefill": base_prefill, "decode": base_decode},
        "params": {"preset": args.preset, "model_id": model_id, "device": args.device, "dtype": args.dtype,
                   "batch": args.batch, "prompt_len": args.prompt_len, "decode_len": args.decode_len,
                   "block_size": args.block_size, "reps": args.reps, "warmup_reps": 1,
                   "enforce_eager": args.enforce_eager, "num_cuda_graphs": num_graphs,
                   "kv_bytes": engine.layout.total_nbytes},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"prefill {report['prefill_tokens_per_s']:.0f} tok/s ({report['prefill_ratio']:.2f}x dense), "
              f"decode {report['decode_tokens_per_s']:.0f} tok/s ({report['decode_ratio']:.2f}x dense)")


if __name__ == "__main__":
    main()
