"""Reference engine throughput: prefill and decode tokens/s, against the hardware's limits.

    python benchmarks/engine_throughput.py --json                       # tiny, float32, CPU
    python benchmarks/engine_throughput.py --preset small --device cuda --dtype bfloat16 --batch 32 --json
    python benchmarks/engine_throughput.py --preset small --device cuda --dtype bfloat16 --enforce-eager --json

The figure: `EngineCore` (scheduler + paged KV cache + sampling, prefix caching off) runs `batch`
prompts of `prompt_len` tokens, then decodes `decode_len` tokens each. Prefill time runs from
adding the requests until every request has its first token; decode time from there to the end.

The limits, measured in the same run (benchmarks/limits.py): prefill against its FLOPs over the
device's matmul rate in the same dtype (`prefill_mfu`); decode against the bytes its steps must read
(the weights once per step plus every request's KV so far) over the device's memory bandwidth
(`decode_fraction_of_limit`). On CUDA the engine replays decode steps from CUDA graphs unless
`--enforce-eager`. Each figure: warm-up, then the median and min over `--reps` repetitions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from common import exit_if_missing, machine_info, versions
from limits import decode_step_nbytes, matmul_rate, memory_bandwidth, prefill_flops, sync

from kvbridge.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvbridge.engine.core import EngineCore
from kvbridge.engine.sampling_params import SamplingParams


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
    exit_if_missing("engine_throughput", args.device)

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
        engine_times = []
        for rep in range(args.reps + 1):  # rep 0 warms up
            prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.batch)]
            engine_run = run_engine(engine, prompts, args.decode_len, rep)
            if rep:
                engine_times.append(engine_run)
        model_id, num_graphs = engine.model_id, engine.runner.num_cuda_graphs
        model, layout = engine.runner.model, engine.layout
        flops = prefill_flops(model, args.prompt_len, args.batch)
        # Decode steps see contexts from prompt_len to prompt_len + decode_len - 1: their mean.
        step_nbytes = decode_step_nbytes(model, layout.block_nbytes // layout.block_size, args.batch,
                                         args.prompt_len + (args.decode_len - 1) // 2)  # fmt: skip
        kv_bytes = layout.total_nbytes
    finally:
        engine.shutdown()
    del model, engine
    compute = matmul_rate(args.device, getattr(torch, args.dtype))
    bandwidth = memory_bandwidth(args.device)

    prefill_tokens, decode_tokens = args.batch * args.prompt_len, args.batch * args.decode_len
    prefill = summarize([t[0] for t in engine_times], prefill_tokens)
    decode = summarize([t[1] for t in engine_times], decode_tokens)
    decode_limit_s = args.decode_len * step_nbytes / bandwidth["bytes_per_s"]
    report = {
        "benchmark": "engine_throughput",
        "prefill_tokens_per_s": prefill["tokens_per_s"],
        "decode_tokens_per_s": decode["tokens_per_s"],
        "baseline": "prefill: its FLOPs over a measured matmul rate (MFU); decode: bytes read over a measured copy rate",
        "prefill_mfu": flops / prefill["median_s"] / compute["flop_per_s"],
        "decode_fraction_of_limit": decode_limit_s / decode["median_s"],
        "prefill_flops": flops,
        "decode_step_bytes_read": step_nbytes,
        "matmul_rate": compute,
        "memory_bandwidth": bandwidth,
        "engine": {"prefill": prefill, "decode": decode},
        "params": {"preset": args.preset, "model_id": model_id, "device": args.device, "dtype": args.dtype,
                   "batch": args.batch, "prompt_len": args.prompt_len, "decode_len": args.decode_len,
                   "block_size": args.block_size, "reps": args.reps, "warmup_reps": 1,
                   "enforce_eager": args.enforce_eager, "num_cuda_graphs": num_graphs,
                   "kv_bytes": kv_bytes},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"prefill {report['prefill_tokens_per_s']:.0f} tok/s (MFU {report['prefill_mfu']:.2f}), "
              f"decode {report['decode_tokens_per_s']:.0f} tok/s ({report['decode_fraction_of_limit']:.2f} of the "
              f"memory-bandwidth limit)")


if __name__ == "__main__":
    main()
