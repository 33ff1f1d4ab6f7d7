"""Legs in turn against legs at once on ONE pair of vLLM servers with KVBridgeConnector, alternating.

    .venv-vllm/bin/python benchmarks/vllm_handoff_pair.py --json                      # CPU, 1,000 tokens
    python3 benchmarks/vllm_handoff_pair.py --json --device cuda --prompt-len 4096    # GPU vLLM (0.25)

`vllm_pd.py` runs each arm on servers of its own, so two arms differ by the spread between server
instances as well as by how they send the legs: on the GPU the same prefill leg took 25.7 ms on one
pair and 40.6 ms on another in one run, more than the hand-off itself costs. This benchmark boots one
kvbridge prefill server and one decode server (the decode with its hand-off inbox, `handoff_inbox`)
and sends, per round, one fresh prompt in each mode, in this order:

  1. `in_turn`: the prefill leg, then the decode leg with the params it returned (vLLM's toy proxy);
  2. `at_once`: both legs at once through the hand-off (the prefill offers its params to the
     decode's inbox as it finishes; what `kvbridge proxy` does once it knows the decode's inbox);
  3. `beside_waiting_decode`: the prefill leg alone while a decode leg waits for an offer that no
     prefill sends (the decode computes that prompt itself after its `handoff_wait_s`): whether a
     decode engine waiting for an offer slows a prefill that shares its machine (or its GPU).
  4. `colocated`: the whole request sent to the prefill server without kv_transfer_params, which
     answers it itself (its connector idle for it): the TTFT without P/D, on the same server, with
     the same kernels and graphs, measured between the P/D requests (a colocated vLLM without a
     connector can only be faster, by the connector's scheduler hooks per step).

Per mode: `prefill_leg_s` (the whole prefill response), `ttft_s` (the user's: in turn, prefill leg +
the decode leg's first streamed token; at once, the decode leg's first token) and `after_prefill_s`
(TTFT minus that request's prefill leg). `paired` gives, per round, at once minus in turn: the same
servers, prompts of the same length, a few hundred milliseconds apart. `ttft_vs_colocated` divides
each P/D mode's median TTFT by the colocated one.

`--sync-ipc-reads` gives the decode the option of that name (same-GPU reads in the step that schedules
the request, both modes; on CPU it changes nothing: no read there is by CUDA IPC).

On CPU the prefill server is pinned to core 0 and the decode server to core 1 (as `vllm_pd.py`); on
CUDA both share one GPU, with CUDA graphs unless `--enforce-eager`. The model is `vllm_pd.py`'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import secrets
import sys
import tempfile
import time

import vllm_pd as pd  # sys.path: this directory and the vLLM test harness (vllm_pd puts the harness there)
from common import machine_info
from vllm_client import _prefill_leg_body, complete, handoff_inbox, pd_complete, pd_complete_handoff, warm_up_pd
from vllm_server import stop_all

MODES = ("in_turn", "at_once", "beside_waiting_decode", "colocated")
WAITING_DECODE_S = 1.0  # the decode's handoff_wait_s: how long a decode leg offered nothing waits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default: 1,000 on CPU, 4,096 on CUDA)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds, each one prompt per mode")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no torch.compile, no CUDA graphs")
    parser.add_argument("--sync-ipc-reads", action="store_true",
                        help="the decode reads a same-GPU prefill's KV in the step that schedules the request "
                             "(NixlConnector option sync_ipc_reads; vllm_pd's arm modifier `sync`)")  # fmt: skip
    parser.add_argument("--idle-step-wait-s", type=float, default=None,
                        help="the decode's NixlConnector option idle_step_wait_s (default: the connector's; 0: never wait)")
    parser.add_argument("--vllm-cache-root", default=None, help="CUDA: vLLM's compile cache (default: a temporary one)")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.prompt_len = args.prompt_len or (4096 if args.device == "cuda" else 1000)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.max_model_len = args.prompt_len + args.max_tokens + 64
    # vllm_pd.start_pd_servers' placement: on CPU the prefill on core 0 and the decode on core 1; on CUDA one GPU
    args.prefill_cpus, args.decode_cpus = (None, None) if args.device == "cuda" else ([0], [1])
    args.prefill_gpu = args.decode_gpu = None
    return args


def start_pair(args, model: str, log_dir: str):
    """One kvbridge prefill server and one decode server with its hand-off inbox, ready."""
    arm = "kvbridge@sync+once" if args.sync_ipc_reads else "kvbridge@once"
    idle_wait = {} if args.idle_step_wait_s is None else {"idle_step_wait_s": args.idle_step_wait_s}
    return pd.start_pd_servers(args, arm, model, log_dir, name="pair",
                               decode_extra_config={"handoff_wait_s": WAITING_DECODE_S} | idle_wait)  # fmt: skip


def one_round(args, prefill_url: str, decode_url: str, inbox: dict, prompts) -> dict[str, tuple[float, float | None]]:
    """(prefill leg, TTFT) per mode for one fresh prompt each."""
    timeout = args.request_timeout
    out = {}
    r = pd_complete(prefill_url, decode_url, pd.body(args, next(prompts)), timeout_s=timeout)
    out["in_turn"] = (r.prefill.ttft_s, r.prefill.ttft_s + r.decode.ttft_s)
    time.sleep(0.2)
    r = pd_complete_handoff(prefill_url, decode_url, pd.body(args, next(prompts)), inbox, timeout_s=timeout)
    out["at_once"] = (r.prefill.ttft_s, r.decode.ttft_s)
    time.sleep(0.2)
    waiting = {**pd.body(args, next(prompts)),
               "kv_transfer_params": {"do_remote_prefill": True, "handoff_key": secrets.token_hex(32), "handoff_inbox": inbox}}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decode = pool.submit(complete, decode_url, waiting, timeout_s=timeout)
        time.sleep(0.05)  # the decode leg is in its engine, waiting
        alone = complete(prefill_url, _prefill_leg_body(pd.body(args, next(prompts))), timeout_s=timeout)
        decode.result()
    out["beside_waiting_decode"] = (alone.ttft_s, None)  # no TTFT: that decode computes its prompt itself
    time.sleep(0.2)
    whole = complete(prefill_url, pd.body(args, next(prompts)), timeout_s=timeout)
    out["colocated"] = (None, whole.ttft_s)  # no prefill leg
    return out


def stats(samples: list[float | None]) -> dict:
    kept = [s for s in samples if s is not None]  # None: not measured in that mode
    return pd.percentiles(kept) if kept else {}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="vllm-pair-") as tmp:
        log_dir = args.log_dir or tmp
        os.makedirs(log_dir, exist_ok=True)
        args.vllm_cache_root = args.vllm_cache_root or os.path.join(tmp, "vllm-cache")
        spec = pd.CUDA_BENCH_MODEL if args.device == "cuda" else pd.BENCH_MODEL
        model = pd.make_random_llama_checkpoint(os.path.join(tmp, "model"), **spec)
        rng = random.Random(args.seed)
        prompts = iter([[rng.randrange(3, spec["vocab_size"]) for _ in range(args.prompt_len)]
                        for _ in range((len(MODES) + 1) * (args.rounds + 1) + 2)])  # fmt: skip
        prefill, decode = start_pair(args, model, log_dir)
        try:
            warm_up_pd(prefill.url, decode.url, pd.body(args, next(prompts)), timeout_s=args.request_timeout)
            inbox = handoff_inbox(prefill.url, decode.url, pd.body(args, next(prompts)), timeout_s=args.request_timeout)
            one_round(args, prefill.url, decode.url, inbox, prompts)  # warm-up: every mode's path once
            rounds = [one_round(args, prefill.url, decode.url, inbox, prompts) for _ in range(args.rounds)]
            gauges = pd.scrape_metrics(decode.url, ("kvbridge_",))
        finally:
            stop_all([prefill, decode])
    modes = {}
    for mode in MODES:
        legs = [r[mode][0] for r in rounds]
        ttfts = [r[mode][1] for r in rounds]
        modes[mode] = {"prefill_leg_s": stats(legs), "ttft_s": stats(ttfts),
                       "after_prefill_s": stats([t - p if None not in (p, t) else None for p, t in zip(legs, ttfts)])}  # fmt: skip
    paired = {
        f"{what}_at_once_minus_in_turn_ms": [round((r["at_once"][i] - r["in_turn"][i]) * 1e3, 2) for r in rounds]
        for i, what in enumerate(("prefill_leg", "ttft"))
    }
    colocated = modes["colocated"]["ttft_s"]["p50"]
    return {
        "benchmark": "vllm_handoff_pair",
        "modes": modes,
        "ttft_vs_colocated": {mode: round(modes[mode]["ttft_s"]["p50"] / colocated, 3) for mode in ("in_turn", "at_once")},
        "paired": paired,
        "decode_counters": {k: v for k, v in gauges.items() if any(w in k for w in ("offer", "granted", "sync_reads", "idle_step"))},
        "params": {k: v for k, v in vars(args).items() if k != "json"} | {"model_spec": spec},
        "machine": machine_info(args.device),
        "versions": pd.package_versions(),
    }


def main() -> int:
    args = parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        for mode, row in report["modes"].items():
            leg = f"prefill leg {row['prefill_leg_s']['p50'] * 1e3:.1f} ms" if row["prefill_leg_s"] else ""
            ttft = f"TTFT {row['ttft_s']['p50'] * 1e3:.1f} ms" if row["ttft_s"] else ""
            print(f"{mode:>22}: {', '.join(x for x in (leg, ttft) if x)}")
        print("TTFT / colocated:", report["ttft_vs_colocated"])
        print("at once minus in turn, per round (ms):", report["paired"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
