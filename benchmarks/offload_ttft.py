"""Time to first token on a host-tier hit vs recompute, for long prompts.

    python benchmarks/offload_ttft.py --json                        # CUDA if present, else CPU
    python benchmarks/offload_ttft.py --json --device cpu --prompt-len 1024

Per repetition: a fresh random prompt is generated with max_tokens=1 (a cold prefill: the
baseline, recompute, measured in the same run; its blocks are stored to the host tier as a side
effect), then `reset_prefix_cache()` (waits for those stores) empties the GPU-side cache, and the
same prompt is generated again: its KV comes back from the host tier, only the last token is
computed. TTFT is the wall time of `generate(prompt, max_tokens=1)`. Warm-up first; median and
min of `--reps` repetitions. The first token of the hit must equal the recompute's.
`hit_timeline_ms`: one more hit, step by step (each step's time, and the waits between steps that
computed nothing), to show where a hit's time goes.

The limits, measured in the same run (benchmarks/limits.py): recompute at best takes the prompt's
prefill FLOPs over the device's matmul rate (`recompute_limit_s`: a hit is only worth what it saves
against that, not against this engine's own prefill), and a hit at best takes the prompt's KV bytes
over a pinned host -> device copy (`hit_limit_s`, one decode step not counted).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import exit_if_missing, machine_info, versions  # noqa: E402
from limits import host_load_rate, matmul_rate, prefill_flops  # noqa: E402

from kvbridge import LLM, SamplingParams  # noqa: E402


def hit_timeline(llm: LLM, prompt: dict, params: SamplingParams) -> list[list]:
    """Where one more hit's time goes: [what, ms] per engine step ("computed" or "idle", the step's
    own time) and per wait between steps ("wait"), from `add_request` to the first token. The prompt
    is generated cold first and its GPU blocks dropped, as in the repetitions."""
    llm.generate(prompt, params)
    assert llm.reset_prefix_cache()
    engine, events = llm.engine, []
    start = last = time.perf_counter()
    engine.add_request("timeline", prompt["prompt_token_ids"], params)
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        events.append(["idle" if engine.is_idle else "computed", round((now - last) * 1e3, 3)])
        if any(o.finished for o in outputs):
            break
        if engine.is_idle:
            engine.wait_for_work(1e-4)
            last, now = now, time.perf_counter()
            events.append(["wait", round((now - last) * 1e3, 3)])
        last = now
    events.append(["total", round((time.perf_counter() - start) * 1e3, 3)])
    assert llm.reset_prefix_cache()
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="a preset or a checkpoint directory (default: kv8b on CUDA, small on CPU)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 4096 on CUDA, 1024 on CPU")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    exit_if_missing("offload_ttft", args.device)

    is_cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if is_cuda else "float32")
    args.model = args.model or ("kv8b" if is_cuda else "small")
    prompt_len = args.prompt_len or (4096 if is_cuda else 1024)
    blocks_per_prompt = -(-(prompt_len + 1) // args.block_size)
    host_blocks = (args.reps + args.warmup + 1) * blocks_per_prompt
    llm = LLM(
        model=args.model, dtype=dtype, device=args.device, seed=args.seed, block_size=args.block_size,
        num_blocks=2 * blocks_per_prompt + 2, max_num_batched_tokens=max(2048, prompt_len),
        kv_transfer_config={"connector": "OffloadingConnector", "extra": {"host_num_blocks": host_blocks}},
    )  # fmt: skip
    # logprobs: in 16-bit a hit and a recompute run other attention kernels (the hit computes the
    # prompt's tail against cached keys), so a near tie may pick another token; the check below
    # tells a near tie from wrong KV.
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
    rng = random.Random(args.seed)
    recompute, hit, hit_tokens = [], [], 0

    def ttft(prompt: dict):  # (seconds, the first token's TokenLogprobs)
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        return time.perf_counter() - start, out.outputs[0].logprobs[0]

    def same_answer(hit, cold) -> bool:
        """The same token, or (16-bit only) the other of a near tie: both tokens in both top 2s, their
        logprobs within 0.1 of each other. Wrong KV gives an unrelated distribution."""
        if hit.token_id == cold.token_id:
            return True
        top_hit, top_cold = dict(hit.top), dict(cold.top)
        return dtype != "float32" and all(
            t in top_hit and t in top_cold and abs(top_hit[t] - top_cold[t]) < 0.1 for t in (hit.token_id, cold.token_id)
        )

    for rep in range(args.warmup + args.reps):
        prompt = {"prompt_token_ids": [rng.randrange(256) for _ in range(prompt_len)]}
        cold_s, cold_tokens = ttft(prompt)
        assert llm.reset_prefix_cache()
        before = llm.get_stats()["num_external_tokens"]
        hit_s, hit_tokens_out = ttft(prompt)
        assert same_answer(hit_tokens_out, cold_tokens), f"a host-tier hit answered {hit_tokens_out}, recompute {cold_tokens}"
        assert llm.reset_prefix_cache()
        if rep >= args.warmup:
            recompute.append(cold_s)
            hit.append(hit_s)
            hit_tokens = llm.get_stats()["num_external_tokens"] - before
    timeline = hit_timeline(llm, {"prompt_token_ids": [rng.randrange(256) for _ in range(prompt_len)]}, params)
    stats = llm.get_stats()["connector"]
    flops = prefill_flops(llm.engine.runner.model, prompt_len)
    kv_bytes = hit_tokens * llm.engine.layout.block_nbytes // args.block_size
    llm.shutdown()
    compute = matmul_rate(args.device, getattr(torch, dtype))
    load = host_load_rate(args.device)
    recompute_limit_s = flops / compute["flop_per_s"]
    report = {
        "benchmark": "offload_ttft",
        "hit_ttft_s": statistics.median(hit),
        "recompute_ttft_s": statistics.median(recompute),
        "speedup": statistics.median(recompute) / statistics.median(hit),
        "baseline": "recompute at the device's measured matmul rate (the prompt's FLOPs / rate); the hit's bytes "
                    "over a measured host -> device copy",
        "recompute_limit_s": recompute_limit_s,
        "speedup_vs_recompute_limit": recompute_limit_s / statistics.median(hit),
        "recompute_mfu": recompute_limit_s / statistics.median(recompute),
        "hit_limit_s": kv_bytes / load["bytes_per_s"],
        "hit_kv_bytes": kv_bytes,
        "matmul_rate": compute,
        "host_load_rate": load,
        "hit_ttft_min_s": min(hit),
        "recompute_ttft_min_s": min(recompute),
        "tokens_from_host_per_hit": hit_tokens,
        "hit_timeline_ms": timeline,
        "load_latency": stats["worker"]["load_latency"],
        "store_latency": stats["worker"]["store_latency"],
        "params": {
            "model": args.model, "dtype": dtype, "prompt_len": prompt_len, "block_size": args.block_size,
            "reps": args.reps, "warmup": args.warmup, "seed": args.seed,
        },  # fmt: skip
        "machine": machine_info(args.device),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"TTFT hit {report['hit_ttft_s'] * 1e3:.1f} ms (limit {report['hit_limit_s'] * 1e3:.1f} ms), "
              f"recompute {report['recompute_ttft_s'] * 1e3:.1f} ms (limit {recompute_limit_s * 1e3:.1f} ms): "
              f"{report['speedup_vs_recompute_limit']:.1f}x a recompute at the FLOP limit")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
