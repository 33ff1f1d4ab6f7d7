"""Reference engine decode step time at a given batch size, against the memory-bandwidth limit.

    python benchmarks/decode_step.py --json                                           # tiny, CPU
    python benchmarks/decode_step.py --json --preset kv8b --device cuda --dtype bfloat16 --batch 1 --batch 32

The figure: the wall time of one `EngineCore.step()` whose every request decodes one token
(scheduler, block bookkeeping, the forward, sampling and output building), with `--batch` requests
of `--context-len` tokens. Measured twice: CUDA graphs on (the default) and `enforce_eager=True`.
Each repetition is one step; the clock starts after a device synchronize and stops after one.

The limit, measured in the same run (benchmarks/limits.py): a decode step must read the weights
once and every request's whole KV; those bytes over the device's memory bandwidth (a device-to-device
copy of a buffer past every cache, read + written bytes per second) give the fastest step this
device can take. `fraction_of_limit` = limit / step time (1.0 is the hardware's best).
Each figure: `--warmup` steps (the first captures the graph), then the median and min over `--reps` steps.

`--profile` adds, per batch, where a CUDA-graph step's time goes: the GPU time of its kernels and
copies per step (torch.profiler over `--reps` more steps), the rest of the step (host work the GPU
waits for), and the kernels that take most of the GPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from common import exit_if_missing, machine_info, versions
from limits import decode_step_nbytes, memory_bandwidth, sync

from kvbridge.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvbridge.engine.core import EngineCore
from kvbridge.engine.sampling_params import SamplingParams


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def engine_step_times(engine: EngineCore, prompts: list[list[int]], num_steps: int, profile_steps: int = 0):
    """Prefill `prompts`, then the time of each of `num_steps` steps in which every request decodes;
    with `profile_steps`, also the device-time profile of that many more steps (else None)."""
    # Requests admitted early decode while later ones prefill: max_tokens leaves them all running.
    params = SamplingParams(max_tokens=num_steps + profile_steps + len(prompts) + 1, temperature=0.0, ignore_eos=True)
    ids = [f"b{len(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step())
    device = engine.runner.device
    times = [timed(engine.step, device) for _ in range(num_steps)]
    profile = device_profile(engine, device, profile_steps) if profile_steps else None
    assert engine.get_stats()["num_running"] == len(prompts), "a request finished inside the timed steps"
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()
    return times, profile


def device_profile(engine: EngineCore, device, num_steps: int, top: int = 8) -> dict:
    """GPU time per step (kernels and copies, from torch.profiler) against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = [timed(engine.step, device) for _ in range(num_steps)]
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / num_steps
    wall_ms = statistics.median(wall) * 1e3
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "steps": num_steps, "wall_ms_median": wall_ms, "gpu_ms_per_step": gpu_ms,
        "not_on_gpu_ms": wall_ms - gpu_ms,
        "top_kernels_ms_per_step": {e.key[:90]: e.self_device_time_total / 1e3 / num_steps for e in kernels[:top]},
    }


def summarize(times: list[float], warmup: int) -> dict:
    timed_steps = times[warmup:]
    return {"median_ms": statistics.median(timed_steps) * 1e3, "min_ms": min(timed_steps) * 1e3,
            "reps": len(timed_steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1 and 32)")
    parser.add_argument("--context-len", type=int, default=1024, help="prompt tokens of every request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="add the GPU-time profile of graph steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_if_missing("decode_step", args.device)
    batches = args.batch or [1, 32]

    rng = random.Random(args.seed)
    prompts = {b: [[rng.randrange(256) for _ in range(args.context_len)] for _ in range(b)] for b in batches}
    num_steps = args.warmup + args.reps
    max_tokens = max(batches) * (args.context_len + num_steps * (1 + args.profile) + 1)
    results = {b: {} for b in batches}
    modes = [("graphs", False), ("eager", True)]
    for mode, enforce_eager in modes:
        config = EngineConfig(
            model=ModelConfig(args.preset, args.dtype, args.device, seed=args.seed, enforce_eager=enforce_eager),
            cache=CacheConfig(block_size=args.block_size, num_blocks=-(-max_tokens // args.block_size) + max(batches),
                              enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(8192, args.context_len)),
        )
        engine = EngineCore(config)
        try:
            for b in batches:
                profile_steps = args.reps if args.profile and mode == "graphs" else 0
                times, profile = engine_step_times(engine, prompts[b], num_steps, profile_steps)
                results[b][mode] = summarize(times, args.warmup)
                if profile is not None:
                    results[b]["profile"] = profile
            if mode == "graphs":
                num_graphs = engine.runner.num_cuda_graphs
                kv_bytes_per_token = engine.layout.block_nbytes // engine.layout.block_size
                step_nbytes = {b: decode_step_nbytes(engine.runner.model, kv_bytes_per_token, b, args.context_len)
                               for b in batches}  # fmt: skip
            layout, model_id = engine.layout, engine.model_id
        finally:
            engine.shutdown()

    bandwidth = memory_bandwidth(args.device)
    for b, figures in results.items():
        limit_ms = step_nbytes[b] / bandwidth["bytes_per_s"] * 1e3
        figures["limit"] = {"bytes_read": step_nbytes[b], "limit_ms": limit_ms}
        for mode in [m for m, _ in modes]:
            figures[f"{mode}_fraction_of_limit"] = limit_ms / figures[mode]["median_ms"]
    report = {
        "benchmark": "decode_step",
        "step_ms": {b: r["graphs"]["median_ms"] for b, r in results.items()},
        "fraction_of_limit": {b: r["graphs_fraction_of_limit"] for b, r in results.items()},
        "baseline": "memory-bandwidth limit: weights + the batch's KV over a device copy's rate, same run",
        "memory_bandwidth": bandwidth,
        "batches": results,
        "num_cuda_graphs": num_graphs,
        "params": {"preset": args.preset, "model_id": model_id, "device": args.device, "dtype": args.dtype,
                   "batches": batches, "context_len": args.context_len, "block_size": args.block_size,
                   "reps": args.reps, "warmup_steps": args.warmup,
                   "kv_bytes_per_token": layout.block_nbytes // layout.block_size},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for b, r in results.items():
            print(f"batch {b}: step {r['graphs']['median_ms']:.2f} ms with graphs, "
                  f"{r['eager']['median_ms']:.2f} ms eager; limit {r['limit']['limit_ms']:.2f} ms "
                  f"({r['graphs_fraction_of_limit']:.2f} of it)")


if __name__ == "__main__":
    main()
