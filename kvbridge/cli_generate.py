"""`kvbridge generate`: complete prompts with the reference engine and print the completions.

    kvbridge generate --prompt "Hello, kvbridge"                     # built-in `tiny` model, CPU
    kvbridge generate --model ./my-llama --device cuda --dtype bfloat16 --prompt a --prompt b --json

Heavy imports (torch) happen in `run()`, so `kvbridge --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from kvbridge.cli_errors import error_line
from kvbridge.config import DTYPES
from kvbridge.engine.presets import PRESETS
from kvbridge.errors import KVBridgeError

DEFAULT_PROMPT = "Hello, kvbridge"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = ", ".join(PRESETS)
    parser.add_argument("--model", default="tiny", help=f"a built-in preset ({presets}) or a local HF checkpoint dir")
    parser.add_argument("--prompt", action="append", help=f"a prompt; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens this likely")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the built-in model's weights and the sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache precision")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks (default: 8192 tokens' worth)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks splitting the model, a process each")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.llm import LLM
    from kvbridge.engine.sampling_params import SamplingParams

    prompts = args.prompt or [DEFAULT_PROMPT]
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed if args.temperature > 0 else None,
            ignore_eos=args.ignore_eos,
        )
        start = time.perf_counter()
        with LLM(
            args.model, args.dtype, args.device, seed=args.seed, num_blocks=args.num_blocks,
            tensor_parallel_size=args.tensor_parallel_size,
        ) as llm:
            load_s = time.perf_counter() - start
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            generate_s = time.perf_counter() - start
            model_id = llm.engine.model_id
    except KVBridgeError as exc:
        print(error_line("generate", exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_report(args, model_id, prompts, outputs, load_s, generate_s)))
        return 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"prompt: {prompt!r}")
        print(f"output: {completion.text!r}  ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{model_id} on {args.device}, {args.dtype}: {num_tokens} tokens in {generate_s:.2f} s]")
    return 0


def _report(args, model_id, prompts, outputs, load_s, generate_s) -> dict:
    return {
        "model": args.model,
        "model_id": model_id,
        "device": args.device,
        "dtype": args.dtype,
        "load_s": round(load_s, 4),
        "generate_s": round(generate_s, 4),
        "machine": platform.machine(),
        "outputs": [
            {
                "prompt": prompt,
                "text": o.outputs[0].text,
                "token_ids": o.outputs[0].token_ids,
                "finish_reason": o.outputs[0].finish_reason,
                "num_prompt_tokens": len(o.prompt_token_ids),
            }
            for prompt, o in zip(prompts, outputs)
        ],
    }
