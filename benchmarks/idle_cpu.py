"""Idle nodes: CPU each node process uses with nothing to do, and what NIXL's progress pause costs.

    python benchmarks/idle_cpu.py --json
    python benchmarks/idle_cpu.py --json --idle-s 20 --prompt-lens 128 512 1024 --reps 7

Starts real node processes (`kvbridge serve`, as `kvbridge demo` does): a prefill and a decode
node with the NixlConnector (a NIXL agent and a side channel each), and a node with the
OffloadingConnector. One P/D request (and one request on the offload node) warms them; then each
process's CPU time (all its threads: utime + stime of /proc/<pid>/stat) is read over `--idle-s`
seconds in which nobody talks to them. cores = CPU seconds / wall seconds; the busiest threads
(/proc/<pid>/task) are listed with it.

In the same run, the baseline: the same nodes with KVBRIDGE_NIXL_PROGRESS_DELAY_US=0, NIXL's own
behaviour (its progress thread never pauses). And what the pause costs: for each prompt length,
`--reps` P/D requests by hand (the prefill node with do_remote_decode, then the decode node with
the kv_transfer_params it returned), each with a fresh random prompt. The decode leg's TTFT (its
`kvbridge.ttft_s`: admission to first token = the KV read, its notifications and one forward of
the last token) is the transfer's latency as a client sees it; the P/D TTFT adds the prefill leg's
`e2e_s`. Median and min over the repetitions, after one warm-up request per length. The decode
node's own read figures (posted -> bytes in place, p50/p99 over all lengths) come with them. Node
configurations run one after the other, never at once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from common import machine_info, versions

from kvbridge.serve.launcher import ManagedProcess, http_json, start_node, wait_healthy

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
DELAY_ENV = "KVBRIDGE_NIXL_PROGRESS_DELAY_US"


def cpu_seconds(pid: int, task: str | None = None) -> float:
    """utime + stime of a process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread, keyed "tid name"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[f"{tid} {name}"] = cpu_seconds(pid, tid)
        except OSError:  # the thread ended meanwhile
            pass
    return out


def measure_idle(procs: list[ManagedProcess], idle_s: float) -> dict[str, dict]:
    """Cores each process used over `idle_s` of wall time, and its three busiest threads."""
    pids = {p.name: p.popen.pid for p in procs}
    before = {name: (cpu_seconds(pid), thread_cpu(pid)) for name, pid in pids.items()}
    start = time.monotonic()
    time.sleep(idle_s)
    wall = time.monotonic() - start
    result = {}
    for name, pid in pids.items():
        total0, threads0 = before[name]
        threads = {t: (s - threads0.get(t, 0.0)) / wall for t, s in thread_cpu(pid).items()}
        busiest = sorted(threads.items(), key=lambda kv: -kv[1])[:3]
        result[name] = {
            "cores": (cpu_seconds(pid) - total0) / wall,
            "busiest_threads": {t: round(c, 4) for t, c in busiest},
        }
    return result


def complete(url: str, prompt: list[int], kv_transfer_params: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": kv_transfer_params}
    status, response = http_json(f"{url}/v1/completions", body, timeout_s=120)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {response}")
    return response


def pd_request(prefill: ManagedProcess, decode: ManagedProcess, prompt: list[int]) -> dict[str, float]:
    """One P/D request by hand; the decode leg must have loaded the whole prompt but its last block."""
    first = complete(prefill.url, prompt, {"do_remote_decode": True})
    second = complete(decode.url, prompt, {**first["kv_transfer_params"], "do_remote_prefill": True})
    stats = second["kvbridge"]
    if stats["num_external_tokens"] == 0:
        raise RuntimeError(f"the decode node loaded nothing from the prefill node: {stats}")
    prefill_s = first["kvbridge"]["e2e_s"]
    return {"decode_ttft_s": stats["ttft_s"], "pd_ttft_s": prefill_s + stats["ttft_s"], "prefill_s": prefill_s,
            "kv_bytes": stats["kv_transfer_bytes"]}  # fmt: skip


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values)}


def run_config(args, delay_us: str | None, rng: random.Random) -> dict:
    """Start the three nodes with KVBRIDGE_NIXL_PROGRESS_DELAY_US = `delay_us` (None: unset, the default)."""
    env = {k: v for k, v in os.environ.items() if k != DELAY_ENV}
    if delay_us is not None:
        env[DELAY_ENV] = delay_us
    node_args = ["--num-blocks", str(args.num_blocks), "--max-model-len", str(max(args.prompt_lens) + 64)]
    offload_args = [*node_args, "--kv-connector", "OffloadingConnector",
                    "--kv-connector-extra", json.dumps({"host_num_blocks": args.num_blocks})]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvbridge-idle-") as log_dir:
        procs = []
        try:
            procs.append(start_node("prefill", "prefill", log_dir, args.model, node_args, env))
            procs.append(start_node("decode", "decode", log_dir, args.model, node_args, env))
            procs.append(start_node("offload", "both", log_dir, args.model, offload_args, env))
            wait_healthy(procs, args.startup_timeout_s)
            prefill, decode, offload = procs
            new_prompt = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
            pd_request(prefill, decode, new_prompt(max(args.prompt_lens)))  # warm-up: handshake, first read
            complete(offload.url, new_prompt(max(args.prompt_lens)), {})
            time.sleep(args.settle_s)  # leases released, transfers reported
            idle = measure_idle(procs, args.idle_s)
            latency = {}
            for prompt_len in args.prompt_lens:
                pd_request(prefill, decode, new_prompt(prompt_len))
                rows = [pd_request(prefill, decode, new_prompt(prompt_len)) for _ in range(args.reps)]
                latency[str(prompt_len)] = {
                    "kv_bytes": rows[0]["kv_bytes"],
                    **{key: summary([r[key] for r in rows]) for key in ("decode_ttft_s", "pd_ttft_s", "prefill_s")},
                }
            reads = read_stats(decode)
        finally:
            for proc in procs:
                proc.stop()
    return {"idle": idle, "latency": latency, "decode_reads": reads}


def read_stats(decode: ManagedProcess) -> dict[str, float]:
    """The decode node's NIXL read figures over its recent reads (every prompt length together):
    posted -> bytes in place, and bytes in place -> the prefill's confirmation of the lease."""
    status, state = http_json(f"{decode.url}/v1/kvbridge/state")
    if status != 200:
        raise RuntimeError(f"{decode.url}/v1/kvbridge/state answered {status}: {state}")
    worker = state["stats"]["connector"]["worker"]
    keys = ("num_transfers", "latency_ms_p50", "latency_ms_p99", "confirm_ms_p50", "confirm_ms_p99")
    return {key: worker[key] for key in keys if key in worker}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--idle-s", type=float, default=12.0, help="seconds of idle measured per node set")
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause between warm-up and the idle window")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--startup-timeout-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    load_before = os.getloadavg()
    default = run_config(args, None, rng)
    spinning = run_config(args, "0", rng)
    report = {
        "benchmark": "idle_cpu",
        "idle_cores": {name: r["cores"] for name, r in default["idle"].items()},
        "baseline": f"the same nodes with {DELAY_ENV}=0 (NIXL's own default: its progress thread never pauses)",
        "baseline_idle_cores": {name: r["cores"] for name, r in spinning["idle"].items()},
        "decode_read_ms_p50": {"default": default["decode_reads"].get("latency_ms_p50"),
                               "progress_delay_0": spinning["decode_reads"].get("latency_ms_p50")},
        "decode_ttft_ratio": {  # default / baseline, medians: > 1 means the pause costs latency
            n: default["latency"][n]["decode_ttft_s"]["median"] / spinning["latency"][n]["decode_ttft_s"]["median"]
            for n in default["latency"]
        },
        "details": {"default": default, "progress_delay_0": spinning},
        "load_avg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": machine_info("cpu"),
        "versions": versions(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, cores in report["idle_cores"].items():
            print(f"{name:8s} idle {cores:.4f} cores (delay 0: {report['baseline_idle_cores'][name]:.4f})")
        for n, ratio in report["decode_ttft_ratio"].items():
            print(f"{n:>6s} tokens: decode TTFT default / delay 0 = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
