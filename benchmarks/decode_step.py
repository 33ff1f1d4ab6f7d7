"""Reference engine decode step time at a given batch size, against the memory-bandwidth limit.

    python benchmarks/decode_step.py --json                                           # tiny, CPU
    python benchmarks/decode_step.py --json --preset kv8b --device cuda --dtype bfloat16 --batch 1 --batch 32

The figure: the wall time of one `EngineCore.step()` in steady state, every request decoding one
token (scheduler, block bookkeeping, the forward, sampling and output building), with `--batch`
requests of `--context-len` tokens. A repetition is a run of `--run-steps` consecutive steps, timed
with one device synchronize before the first and one after the last, divided by the count: a
synchronize per step would stop the step asynchronous scheduling launched ahead. Measured in three
modes, each its own engine:

* `graphs`: CUDA graphs, `SchedulerConfig.async_scheduling=True` (the host's work on step k, its
  tokens, outputs and the scheduling of k+1, hides behind the GPU's work on k+1); the headline;
* `graphs_sync`: CUDA graphs, synchronous steps (`--no-async` leaves `graphs` out);
* `eager`: `enforce_eager=True`, synchronous steps.

The limit, measured in the same run (benchmarks/limits.py): a decode step must read the weights
once and every request's whole KV; those bytes over the device's memory bandwidth (a device-to-device
copy of a buffer past every cache, read + written bytes per second) give the fastest step this
device can take. Each mode: `--warmup` steps (the first captures the graph), then the median and
min over `--reps` runs.

JSON keys:
* `step_ms[batch]`: the `graphs` mode's median ms per step (`graphs_sync`'s with `--no-async`);
* `fraction_of_limit[batch]`: limit / that step time (1.0 is the hardware's best);
* `batches[batch][mode]`: `median_ms`, `min_ms` per step over `reps` runs of `run_steps` steps, and
  `async_steps_fraction`, the fraction of timed steps launched while the step before was in flight
  (1.0 in steady async decoding, 0 synchronously); `batches[batch]["limit"]`: `bytes_read`,
  `limit_ms`; `batches[batch][f"{mode}_fraction_of_limit"]`; `batches[batch]["profile"]` with
  `--profile`;
* `memory_bandwidth`, `num_cuda_graphs`, `params`, `machine`, `versions`.

`--profile` adds, per batch, where a step's time goes in the headline mode: the GPU time of its
kernels and copies per step (torch.profiler over `--reps` runs more), the rest of the step (time
the GPU was not busy: host work the GPU waits for, and the gaps between kernels), and the kernels
that take most of the GPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

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


def run_time(engine: EngineCore, device, num_steps: int) -> float:
    """Seconds per step over `num_steps` consecutive steps, synchronized before the first and after the last."""
    return timed(lambda: [engine.step() for _ in range(num_steps)], device) / num_steps


def engine_step_times(engine: EngineCore, prompts: list[list[int]], num_runs: int, run_steps: int,
                      profile_runs: int = 0):  # fmt: skip
    """Prefill `prompts`, then the time per step of each of `num_runs` runs of `run_steps` steps in which
    every request decodes, and the fraction of those steps launched ahead; with `profile_runs`, also the
    device-time profile of that many more runs (else None)."""
    # Requests admitted early decode while later ones prefill: max_tokens leaves them all running.
    num_steps = (num_runs + profile_runs) * run_steps
    params = SamplingParams(max_tokens=num_steps + len(prompts) + 2, temperature=0.0, ignore_eos=True)
    ids = [f"b{len(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step())
    device = engine.runner.device
    num_async = engine.get_stats()["num_async_steps"]
    times = [run_time(engine, device, run_steps) for _ in range(num_runs)]
    async_fraction = (engine.get_stats()["num_async_steps"] - num_async) / (num_runs * run_steps)
    profile = device_profile(engine, device, profile_runs, run_steps) if profile_runs else None
    assert engine.get_stats()["num_running"] == len(prompts), "a request finished inside the timed steps"
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return times, async_fraction, profile


def device_profile(engine: EngineCore, device, num_runs: int, run_steps: int, top: int = 8) -> dict:
    """GPU time per step (kernels and copies, from torch.profiler) against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = [run_time(engine, device, run_steps) for _ in range(num_runs)]
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / (num_runs * run_steps)
    wall_ms = statistics.median(wall) * 1e3
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "runs": num_runs, "run_steps": run_steps, "wall_ms_median": wall_ms, "gpu_ms_per_step": gpu_ms,
        "not_on_gpu_ms": wall_ms - gpu_ms,
        "top_kernels_ms_per_step": {
            e.key[:90]: e.self_device_time_total / 1e3 / (num_runs * run_steps) for e in kernels[:top]
        },
    }


def summarize(times: list[float], async_fraction: float) -> dict:
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "reps": len(times),
            "async_steps_fraction": async_fraction}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1 and 32)")
    parser.add_argument("--context-len", type=int, default=1024, help="prompt tokens of every request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10, help="timed runs")
    parser.add_argument("--run-steps", type=int, default=20, help="consecutive steps per timed run")
    parser.add_argument("--warmup", type=int, default=3, help="runs before the timed ones")
    parser.add_argument("--no-async", action="store_true", help="leave out the asynchronous-scheduling mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="add the GPU-time profile of graph steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_if_missing("decode_step", args.device)
    batches = args.batch or [1, 32]

    rng = random.Random(args.seed)
    prompts = {b: [[rng.randrange(256) for _ in range(args.context_len)] for _ in range(b)] for b in batches}
    num_runs = args.warmup + args.reps
    max_tokens = max(batches) * (args.context_len + num_runs * args.run_steps * (1 + args.profile) + 2)
    results = {b: {} for b in batches}
    # (mode, enforce_eager, async_scheduling); the first is the headline.
    modes = [("graphs", False, True), ("graphs_sync", False, False), ("eager", True, False)]
    if args.no_async:
        modes = modes[1:]
    headline = modes[0][0]
    for mode, enforce_eager, async_scheduling in modes:
        config = EngineConfig(
            model=ModelConfig(args.preset, args.dtype, args.device, seed=args.seed, enforce_eager=enforce_eager),
            cache=CacheConfig(block_size=args.block_size, num_blocks=-(-max_tokens // args.block_size) + max(batches),
                              enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(8192, args.context_len),
                                      async_scheduling=async_scheduling),
        )
        engine = EngineCore(config)
        try:
            for b in batches:
                profile_runs = args.reps if args.profile and mode == headline else 0
                times, async_fraction, profile = engine_step_times(engine, prompts[b], num_runs, args.run_steps,
                                                                   profile_runs)  # fmt: skip
                results[b][mode] = summarize(times[args.warmup :], async_fraction)
                if profile is not None:
                    results[b]["profile"] = profile
            if mode == headline:
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
        for mode, _, _ in modes:
            figures[f"{mode}_fraction_of_limit"] = limit_ms / figures[mode]["median_ms"]
    report = {
        "benchmark": "decode_step",
        "step_ms": {b: r[headline]["median_ms"] for b, r in results.items()},
        "fraction_of_limit": {b: r[f"{headline}_fraction_of_limit"] for b, r in results.items()},
        "baseline": "memory-bandwidth limit: weights + the batch's KV over a device copy's rate, same run",
        "memory_bandwidth": bandwidth,
        "batches": results,
        "num_cuda_graphs": num_graphs,
        "params": {"preset": args.preset, "model_id": model_id, "device": args.device, "dtype": args.dtype,
                   "batches": batches, "context_len": args.context_len, "block_size": args.block_size,
                   "reps": args.reps, "run_steps": args.run_steps, "warmup_runs": args.warmup,
                   "modes": [m for m, _, _ in modes],
                   "kv_bytes_per_token": layout.block_nbytes // layout.block_size},
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for b, r in results.items():
            figures = ", ".join(f"{r[m]['median_ms']:.2f} ms {m}" for m, _, _ in modes)
            print(f"batch {b}: step {figures}; limit {r['limit']['limit_ms']:.2f} ms "
                  f"({r[f'{headline}_fraction_of_limit']:.2f} of it with {headline})")


if __name__ == "__main__":
    main()
