"""`kvbridge <command>`: the command line.

`kvbridge generate` (complete prompts with the reference engine) lives here; the server-side
commands live with what they run (`kvbridge.serve`). Each command is an object with
`add_arguments(parser)` and `run(args) -> int`, imported only when the parser is built, and its
heavy imports (torch) happen in `run()`, so `kvbridge --help` stays fast.

    kvbridge generate --prompt "Hello, kvbridge"                     # built-in `tiny` model, CPU
    kvbridge generate --model ./my-llama --device cuda --dtype bfloat16 --prompt a --prompt b --json
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import sys
import time

from kvbridge import __version__, env
from kvbridge.config import DTYPES
from kvbridge.errors import KVBridgeError

# command -> ("module" or "module:object" with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvbridge.cli:Generate", "generate completions with the reference engine"),
    "serve": ("kvbridge.serve.server", "run an engine behind an OpenAI-compatible HTTP API"),
    "proxy": ("kvbridge.serve.proxy", "route requests to prefill nodes, then decode nodes"),
    "demo": ("kvbridge.serve.demo", "P/D disaggregation on one machine: prefill, decode and proxy processes"),
}

DEFAULT_PROMPT = "Hello, kvbridge"


class Generate:
    """`kvbridge generate`: complete prompts with the reference engine and print the completions."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny", help="a built-in preset (tiny, small) or a local HF checkpoint dir")
        parser.add_argument("--prompt", action="append", help=f"a prompt; repeat for a batch (default {DEFAULT_PROMPT!r})")
        parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
        parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        parser.add_argument("--top-p", type=float, default=1.0)
        parser.add_argument("--top-k", type=int, default=0)
        parser.add_argument("--seed", type=int, default=0, help="seeds the built-in model's weights and the sampling")
        parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
        parser.add_argument("--dtype", default="float32", choices=DTYPES)
        parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        parser.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    @staticmethod
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
            with LLM(args.model, args.dtype, args.device, seed=args.seed, num_blocks=args.num_blocks) as llm:
                load_s = time.perf_counter() - start
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                generate_s = time.perf_counter() - start
                model_id = llm.engine.model_id
        except KVBridgeError as exc:
            print(f"kvbridge generate: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(_generate_report(args, model_id, prompts, outputs, load_s, generate_s)))
            return 0
        for prompt, output in zip(prompts, outputs):
            completion = output.outputs[0]
            print(f"prompt: {prompt!r}")
            print(f"output: {completion.text!r}  ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"[{model_id} on {args.device}, {args.dtype}: {num_tokens} tokens in {generate_s:.2f} s]")
        return 0


def _generate_report(args, model_id, prompts, outputs, load_s, generate_s) -> dict:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (target, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_command=target)
        # Parsers are built eagerly so `--help` works; the heavy imports happen in run().
        _command(target).add_arguments(cmd)
    return parser


def _command(target: str):
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=env.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(_command(args._command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
