"""The reference engine beside vLLM, on the same weights: prefill time and decode step, in one run.

    .venv-vllm/bin/python benchmarks/vllm_engine.py --json                  # CPU: a small random Llama
    python3 benchmarks/vllm_engine.py --json --device cuda --dtype bfloat16 --geometry llama3-8b \\
        --prompt-len 4096 --batch 1 --batch 32                              # GPU with vLLM installed

One random Llama checkpoint (written with transformers, loaded by both engines) and the same prompt
token ids for both. Each engine runs in a child process of its own, one after the other (vLLM's
process-wide state and memory never meet the other's), through its offline `LLM` API with the same
settings: greedy, `ignore_eos`, prefix caching off, CUDA graphs where the engine has them, and on a
GPU asynchronous scheduling (vLLM 0.25 turns it on by default there; the reference engine is asked).

- prefill: the wall time of `generate(prompt, max_tokens=1)` for a fresh `--prompt-len`-token prompt;
- decode step at batch B: B fresh prompts generated with `max_tokens=1 + --decode-steps` and, in the
  same repetition, B other fresh prompts with `max_tokens=1`; the difference over the steps.
Each figure: `--warmup` untimed repetitions, then the median and min of `--reps`.

In the same run the limits (benchmarks/limits.py): the prefill's FLOPs over a measured matmul rate
(MFU) and a decode step's bytes (weights + the batch's KV) over the measured memory bandwidth, so
both engines are read against the hardware, and `ratio_to_vllm` (vLLM's time / the reference
engine's: above 1, the reference engine is faster) against each other.
"""

from __future__ import annotations

import argparse
import json
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


# ---------------------------------------------------------------------- one engine, in a child process


class Engine:
    """`generate(batch of token-id prompts, max_tokens)` through one engine's offline LLM."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        max_len = args.prompt_len + args.decode_steps + 16
        max_batch = max(args.batch)
        if name == "kvbridge":
            from kvbridge import LLM, SamplingParams

            blocks = -(-max_len // 16) * max_batch * 2 + 8
            self.llm = LLM(model=args.checkpoint, dtype=args.dtype, device=args.device, block_size=16,
                           num_blocks=blocks, enable_prefix_caching=False, max_num_seqs=max_batch,
                           max_num_batched_tokens=max(2048, args.prompt_len), max_model_len=max_len,
                           async_scheduling=args.device.startswith("cuda"))  # fmt: skip
        else:
            from vllm import LLM, SamplingParams

            extra = {"gpu_memory_utilization": 0.85} if args.device.startswith("cuda") else {}
            self.llm = LLM(model=args.checkpoint, dtype=args.dtype, enable_prefix_caching=False, max_model_len=max_len,
                           max_num_seqs=max_batch, max_num_batched_tokens=max(2048, args.prompt_len), seed=0,
                           **extra)  # fmt: skip
        self.name, self.params = name, SamplingParams

    def generate(self, batch: list[list[int]], max_tokens: int) -> float:
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in batch], params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "an answer stopped early"
        return elapsed


def measure(args: argparse.Namespace) -> dict:
    """The child: prefill and decode-step samples of one engine."""
    use_inprocess_engine()
    engine = Engine(args.child, args)
    seed = iter(range(1, 10**6))
    prefill = []
    for rep in range(args.warmup + args.reps):
        elapsed = engine.generate(prompts(next(seed), 1, args.prompt_len, args.vocab_size), 1)
        if rep >= args.warmup:
            prefill.append(elapsed)
    steps = {}
    for batch in args.batch:
        samples = []
        for rep in range(args.warmup + args.reps):
            long_s = engine.generate(prompts(next(seed), batch, args.prompt_len, args.vocab_size), 1 + args.decode_steps)
            short_s = engine.generate(prompts(next(seed), batch, args.prompt_len, args.vocab_size), 1)
            if rep >= args.warmup:
                samples.append((long_s - short_s) / args.decode_steps)
        steps[batch] = summarize(samples)
    return {"prefill": summarize(prefill), "decode_step": steps}


# ---------------------------------------------------------------------- the run


def model_figures(checkpoint: str, args: argparse.Namespace) -> tuple[int, dict[int, int]]:
    """(prefill FLOPs, decode-step bytes per batch) of the checkpoint, counted by the reference
    engine's model on the meta device (no weights allocated)."""
    import torch

    from limits import decode_step_nbytes, prefill_flops
    from vllm_checkpoint import kv_bytes_per_token

    model = meta_model(checkpoint, args.dtype)
    kv_per_token = kv_bytes_per_token(checkpoint, getattr(torch, args.dtype).itemsize)
    flops = prefill_flops(model, args.prompt_len)
    context = args.prompt_len + args.decode_steps // 2
    return flops, {b: decode_step_nbytes(model, kv_per_token, b, context) for b in args.batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, action="append", help="decode batch size (repeatable; default 1 and 8)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--engines", default="kvbridge,vllm")
    parser.add_argument("--child", choices=("kvbridge", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batch = args.batch or [1, 8]
    if args.child:
        print(json.dumps(measure(args)), flush=True)
        return 0

    from common import exit_if_missing, machine_info, versions

    exit_if_missing("vllm_engine", args.device)
    if "vllm" in args.engines.split(",") and not has_vllm():
        print(json.dumps({"benchmark": "vllm_engine", "skipped": "needs vLLM (scripts/vllm-env builds an environment)"}))
        return 0
    import torch

    from limits import matmul_rate, memory_bandwidth

    geometry = GEOMETRIES[args.geometry]
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-engine-") as tmp:
        checkpoint = args.checkpoint or write_checkpoint(tmp, args.geometry, args.prompt_len + args.decode_steps,
                                                         args.dtype, args.device)  # fmt: skip
        vocab_size = vocab_size_of(checkpoint)
        flops, step_nbytes = model_figures(checkpoint, args)
        results = {}
        for engine in args.engines.split(","):
            argv = [sys.executable, __file__, "--child", engine, "--checkpoint", checkpoint, "--vocab-size",
                    str(vocab_size), "--device", args.device, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
                    "--decode-steps", str(args.decode_steps), "--reps", str(args.reps), "--warmup", str(args.warmup),
                    *(f"--batch={b}" for b in args.batch)]  # fmt: skip
            results[engine] = run_child(argv, engine)
    compute = matmul_rate(args.device, getattr(torch, args.dtype))
    bandwidth = memory_bandwidth(args.device)

    report: dict = {"benchmark": "vllm_engine"}
    for engine, figures in results.items():
        prefill_s = figures["prefill"]["median_ms"] / 1e3
        report[f"{engine}_prefill_ms"] = figures["prefill"]["median_ms"]
        report[f"{engine}_prefill_mfu"] = flops / prefill_s / compute["flop_per_s"]
        for batch, step in figures["decode_step"].items():
            report[f"{engine}_step_ms_batch{batch}"] = step["median_ms"]
            report[f"{engine}_step_fraction_of_limit_batch{batch}"] = (
                step_nbytes[int(batch)] / bandwidth["bytes_per_s"] / (step["median_ms"] / 1e3)
            )
    if {"kvbridge", "vllm"} <= results.keys():
        report["prefill_ratio_to_vllm"] = results["vllm"]["prefill"]["median_ms"] / results["kvbridge"]["prefill"]["median_ms"]
        for batch in results["kvbridge"]["decode_step"]:
            report[f"step_ratio_to_vllm_batch{batch}"] = (
                results["vllm"]["decode_step"][batch]["median_ms"] / results["kvbridge"]["decode_step"][batch]["median_ms"]
            )
    report.update({
        "baseline": "vLLM's offline LLM on the same checkpoint and prompts; the FLOP and memory-bandwidth limits measured in this run",
        "detail": results, "prefill_flops": flops, "decode_step_bytes_read": step_nbytes,
        "matmul_rate": compute, "memory_bandwidth": bandwidth,
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "child", "vocab_size")} | {"geometry_shape": geometry},
        "machine": machine_info(args.device), "versions": versions() | engine_versions(),
    })  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if isinstance(value, float):
                print(f"{key}: {value:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
