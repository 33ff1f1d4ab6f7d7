"""`kvbridge demo`: P/D disaggregation on one machine, checked against one colocated engine.

Starts a prefill node, a decode node and the proxy as separate processes on loopback, sends
prompts of mixed lengths through the proxy (greedy), prints each completion with the KV bytes
the decode node pulled and the times, and checks that each completion equals what one engine
without a connector gives in this process. While they start, progress goes to stderr (which
process starts where, with its log, and when each is ready). Exit code 0: all match; 1: a mismatch
or a failed request; 2: a bad option or the cluster did not start. The children are stopped on
every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from kvbridge.cli_errors import error_line
from kvbridge.config import DTYPES
from kvbridge.errors import KVBridgeError, NodeStartError

_STORY = (
    "Prefill and decode have different appetites: prefill is a burst of matrix multiplies over the "
    "whole prompt, decode is a long trickle of one token at a time that mostly reads memory. "
    "Running them on separate machines lets each be sized and batched for its own work, "
    "provided the prompt's KV cache moves from one to the other quickly and correctly. "
)


def demo_prompts(num_prompts: int) -> list[str]:
    """Mixed lengths: short, medium, several blocks long, a long shared prefix (partly cached on the
    decode node by then) and an exact repeat (fully cached). Cycles with a numbered suffix."""
    base = [
        "Hello, kvbridge!",
        "The quick brown fox jumps over the lazy dog, twice, for good measure.",
        _STORY,
        _STORY + "Which of the two phases would you put on the bigger machine, and why?",
        "The quick brown fox jumps over the lazy dog, twice, for good measure.",
    ]
    return [base[i % len(base)] + (f" [{i // len(base)}]" if i >= len(base) else "") for i in range(num_prompts)]


def reference_completions(args: argparse.Namespace, prompts: list[str]) -> list[list[int]]:
    """Greedy token ids from one colocated engine (no connector), one prompt at a time."""
    from kvbridge import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with LLM(model=args.model, dtype=args.dtype, seed=args.seed) as llm:
        return [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]


def _request_row(index: int, prompt: str, status: int, body: Any, expected: list[int]) -> dict[str, Any]:
    if status != 200 or not isinstance(body, dict):
        error = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        return {"index": index, "ok": False, "match": False, "error": f"HTTP {status}: {error}"}
    stats = body.get("kvbridge", {})
    proxy = stats.get("proxy", {})
    token_ids = body["choices"][0]["token_ids"]
    return {
        "index": index,
        "ok": True,
        "match": token_ids == expected,
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "completion_tokens": body["usage"]["completion_tokens"],
        "cached_tokens": stats.get("num_cached_tokens", 0),
        "external_tokens": stats.get("num_external_tokens", 0),
        "kv_bytes": stats.get("kv_transfer_bytes", 0),
        "prefill_s": proxy.get("prefill_s"),
        "decode_ttft_s": stats.get("ttft_s"),
        "total_s": proxy.get("prefill_s", 0) + proxy.get("decode_s", 0),
        "text": body["choices"][0]["text"],
        "prompt": prompt,
    }


def _print_row(row: dict[str, Any]) -> None:
    if not row["ok"]:
        print(f"[{row['index']}] FAILED {row['error']}")
        return
    mark = "match" if row["match"] else "MISMATCH"
    print(
        f"[{row['index']}] {row['prompt_tokens']:4d} prompt tokens: {row['cached_tokens']:4d} cached on decode, "
        f"{row['external_tokens']:4d} pulled ({row['kv_bytes'] / 1024:7.1f} KiB); prefill {row['prefill_s'] * 1e3:7.1f} ms, "
        f"decode TTFT {row['decode_ttft_s'] * 1e3:7.1f} ms, total {row['total_s'] * 1e3:7.1f} ms  [{mark}]"
    )
    print(f"     prompt: {row['prompt'][:60]!r}{'...' if len(row['prompt']) > 60 else ''}")
    print(f"     completion: {row['text']!r}")


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    from kvbridge import __version__

    versions: dict[str, str | None] = {"kvbridge": __version__, "python": platform.python_version()}
    for name in ("torch", "nixl-cu12", "nixl-cu13", "nixl", "aiohttp"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return versions


class Progress:
    """Start-up progress on stderr (stdout stays the table or the JSON): which process starts, where
    its log is, when it answers, so the seconds before the first request are not silent."""

    def __init__(self, t_start: float) -> None:
        self.t_start = t_start

    def say(self, message: str) -> None:
        print(f"kvbridge demo: [{time.monotonic() - self.t_start:5.1f} s] {message}", file=sys.stderr, flush=True)

    def started(self, proc) -> None:
        self.say(f"starting {proc.name} on {proc.url} (log: {proc.log_path})")

    def ready(self, proc) -> None:
        self.say(f"{proc.name} is ready")


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Start the cluster, compute the reference while it boots, send the prompts. Returns the summary."""
    from kvbridge.engine.presets import check_model_source
    from kvbridge.serve.launcher import PDCluster, http_json

    check_model_source(args.model)  # before three processes start only to fail
    prompts = demo_prompts(args.num_prompts)
    node_args = ["--dtype", args.dtype, "--seed", str(args.seed), "--num-threads", "1"]
    node_args += ["--no-connector"] if args.no_connector else ["--kv-connector", args.kv_connector]
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    cluster = PDCluster(
        args.model, node_args=node_args, startup_timeout_s=args.startup_timeout, log_dir=args.log_dir,
        base_port=args.base_port,
    )  # fmt: skip
    progress = Progress(time.monotonic())
    cluster.start(on_start=progress.started)
    try:
        progress.say(f"computing the reference completions with one {args.model} engine in this process")
        expected = reference_completions(args, prompts)  # while the nodes boot
        progress.say(f"reference done; waiting for the nodes to answer /health (up to {args.startup_timeout:g} s)")
        cluster.wait(on_ready=progress.ready)
        t_ready = time.monotonic()
        progress.say(f"the proxy routes to every node; sending {len(prompts)} prompts through {cluster.proxy_url}")
        rows = []
        for i, prompt in enumerate(prompts):
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            status, response = http_json(f"{cluster.proxy_url}/v1/completions", body, timeout_s=args.request_timeout)
            rows.append(_request_row(i, prompt, status, response, expected[i]))
            if not args.json:
                _print_row(rows[-1])
        t_done = time.monotonic()
        connector_stats = _connector_stats(cluster.decode[0].url)
    finally:
        cluster.stop()
    ok_rows = [r for r in rows if r["ok"]]
    return {
        "requests": len(rows),
        "all_match": all(r["match"] for r in rows),
        "num_failed": len(rows) - len(ok_rows),
        "bytes_transferred": sum(r["kv_bytes"] for r in ok_rows),
        "external_tokens": sum(r["external_tokens"] for r in ok_rows),
        "startup_s": round(t_ready - progress.t_start, 3),
        "requests_s": round(t_done - t_ready, 3),
        "mean_prefill_s": _mean(r["prefill_s"] for r in ok_rows),
        "mean_decode_ttft_s": _mean(r["decode_ttft_s"] for r in ok_rows),
        "decode_connector": connector_stats,
        "per_request": [{k: v for k, v in r.items() if k not in ("text", "prompt")} for r in rows],
        "parameters": {k: getattr(args, k) for k in ("model", "dtype", "seed", "num_prompts", "max_tokens")}
        | {"connector": None if args.no_connector else args.kv_connector},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "versions": _versions(),
    }


# Worker-side connector statistics worth a line in the summary (whichever the connector reports).
_CONNECTOR_STATS = (
    "bytes_transferred", "num_transfers", "num_descriptors", "num_failures", "num_load_errors",
    "latency_ms_p50", "latency_ms_p99", "throughput_gbps",
)  # fmt: skip


def _connector_stats(node_url: str) -> dict[str, Any]:
    """The decode node's own transfer counters, from its admin endpoint ({} without a connector)."""
    from kvbridge.serve.launcher import http_json

    try:
        status, state = http_json(f"{node_url}/v1/kvbridge/state", timeout_s=30)
    except OSError:
        return {}
    worker = state.get("stats", {}).get("connector", {}).get("worker", {}) if status == 200 else {}
    return {k: worker[k] for k in _CONNECTOR_STATS if k in worker}


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 6) if values else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON summary instead of the table")
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts sent through the proxy")
    parser.add_argument("--model", default="tiny", help="built-in preset or local checkpoint directory")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache precision")
    parser.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    parser.add_argument("--kv-connector", default="NixlConnector", help="the nodes' connector")
    parser.add_argument("--no-connector", action="store_true", help="route only; the decode node recomputes")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for the nodes to be healthy")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument(
        "--log-dir", default=None, metavar="DIR",
        help="keep each process's log there as NAME.log (default: a temporary directory, removed at exit)",
    )  # fmt: skip
    parser.add_argument(
        "--base-port", type=int, default=None, metavar="PORT",
        help="pin the ports: the proxy on PORT, prefill0 on PORT+1 (side channel PORT+2), decode0 on PORT+3 "
        "(PORT+4 stays free: a decode node listens on no side channel) (default: free ports)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        print("kvbridge demo: --num-prompts must be at least 1", file=sys.stderr)
        return 2
    if args.base_port is not None and not 0 < args.base_port < 65536 - 4:
        print(f"kvbridge demo: --base-port {args.base_port} leaves no room for 5 ports", file=sys.stderr)
        return 2
    try:
        summary = run_demo(args)
    except NodeStartError as exc:
        print(f"kvbridge demo: the cluster did not start: {exc}", file=sys.stderr)
        return 2
    except KVBridgeError as exc:  # a bad --model, or the in-process reference engine's start-up
        print(error_line("demo", exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvbridge demo: interrupted; all processes stopped", file=sys.stderr)
        return 130
    if args.log_dir:
        print(f"kvbridge demo: the processes' logs are in {args.log_dir}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        verdict = "all completions match the colocated engine" if summary["all_match"] else "MISMATCH"
        print(
            f"{summary['requests']} requests, {summary['bytes_transferred'] / 1024:.1f} KiB of KV pulled by the "
            f"decode node; {verdict}"
        )
        if summary["decode_connector"]:
            print("decode node's connector: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary["decode_connector"].items()))
    return 0 if summary["all_match"] else 1
