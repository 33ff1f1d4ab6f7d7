"""Serving under load: an open-loop streaming client against `kvbridge proxy` over P/D nodes, with faults.

    python benchmarks/serve_load.py --json --check     # 2 prefill + 2 decode nodes; load-prefix vs round-robin
    python benchmarks/serve_load.py --json --num-requests 600 --rate 30 --max-in-flight 32 \
        --kill prefill0@3 --restart prefill0@6           # a prefill node dies 3 s in and is restarted at 6 s
    python benchmarks/serve_load.py --json --proxy-url http://127.0.0.1:8000 \\
        --prefill-url http://127.0.0.1:8100 --decode-url http://127.0.0.1:8200    # attach to running servers

The nodes (`kvbridge serve --role prefill|decode`, NixlConnector) and the proxy run as separate
processes on loopback (kvbridge/serve/launcher.py). Requests arrive as a Poisson process at `--rate`
per second, open loop: an arrival never waits for an earlier completion (`--max-in-flight` caps the
requests in flight as a safety; how often it held one back is reported). Each prompt is one of
`--prefix-groups` shared prefixes of `--prefix-len` tokens followed by a unique suffix, total length
drawn uniformly from `--prompt-len` +- `--len-spread` (likewise the output length); greedy, `ignore_eos`,
streamed. Everything drawn comes from `--seed`, so two runs (and the two routings) send the same
requests at the same offsets.

Per routing: requests/s achieved (completed ones over first arrival to last completion), TTFT from
the scheduled arrival to the first streamed token (so time spent waiting for a slot or a lagging
client counts), inter-token latency (gaps between streamed token chunks), errors seen by the client
by kind (`http_<status>`, `stream_error`: an error event in the stream, `connection`, `timeout`,
`incomplete`: a stream that ended early), with `--check` completions that differ from one colocated
engine's greedy tokens (computed in this process, no connector), the prefix-cache hit rate of the
prefill nodes (their `/metrics` counters, cached / prompt tokens), and leaked blocks: after the run,
every node is polled until it holds no block and no request (`--settle-timeout`, longer than the 30 s
lease a prefill node keeps blocks for a reader that never came); what is still held then is a leak.

`--routing routers` adds vLLM's own router (`vllm-router --vllm-pd-disaggregation`, benchmarks/vllm_router_launch.py)
with its `kv_aware` prefill policy, fed by the prefill nodes' KV events (`--kv-events-config`), and with
`round_robin`; `ratios_vs_round_robin` reads each routing against the proxy's round robin.

`--routing both` runs the arrival schedule twice on the same nodes, each time behind a fresh proxy:
`--routing load-prefix`, then the baseline `--routing round-robin`, with every prefix cache reset
before each, and reports both and their ratios. `--rounds N` repeats that, every other round in
reverse order (ABBA), and reports each round's ratios and their medians. A proxy without `--routing` (read from
`kvbridge proxy --help`) runs its own round-robin once, and `routing.note` says so.

Faults: `--kill NODE@S` (SIGKILL) and `--restart NODE@S` (same command, same ports), S seconds
after the run's start, in every routing's run (a node left down is started again between runs). The fault window runs from the first kill to the
moment the last restarted node answers /health (or to the end if one stays down); requests are
`before` it (ended before it began), `after` it (sent after it ended) or `during` it, and each
group gets its TTFT and errors. When the cap holds requests back, TTFT from the scheduled arrival
includes that wait: `ttft_from_send_ms` is the part the proxy and the nodes took. Leaks are read
once the restarted nodes are healthy again.

`ok` is false (exit code 1) and `problems` says why when a node still holds blocks or requests after
settling or fails its integrity check, a completion is wrong, a restarted node never got healthy, or
a request failed in a run without faults. On a shared machine compare routings by the JSON's
`load_average` of each run too: they run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
from common import machine_info, versions
from vllm_router_launch import VLLM_ROUTER_ROUTINGS, events_args, start_vllm_router

from kvbridge.errors import NodeStartError
from kvbridge.serve.launcher import (
    ManagedProcess,
    cli_argv,
    http_json,
    start_node,
    start_proxy,
    wait_healthy,
    wait_proxy_routes_to_all,
)

ROUTINGS = ("load-prefix", "round-robin")
BASELINE_ROUTING = "round-robin"
# 512 blocks of 16 tokens a node, 32 shared prefixes of 384 tokens (24 blocks each, 768 in all): one
# prefill node's cache holds fewer than all of them, two hold them all. The case prefix-aware routing is for.
NODE_ARGS = "--num-threads 1 --num-blocks 512 --max-model-len 2048"
NODE_ENV = {"OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo"}
MIN_SUFFIX = 16  # tokens of its own every prompt has after its group's prefix
VOCAB = 256  # byte tokens of the built-in presets
NUM_SAMPLES = 5  # error messages and wrong completions quoted per run


# ------------------------------------------------------------------ the arrival schedule


class WorkItem(NamedTuple):
    index: int
    arrival_s: float  # after the run's start
    group: int  # which shared prefix
    prompt_token_ids: list[int]
    max_tokens: int


def _bounded(rng: random.Random, mean: int, spread: float) -> int:
    """Uniform in mean * [1 - spread, 1 + spread], at least 1."""
    return max(1, rng.randint(round(mean * (1 - spread)), round(mean * (1 + spread))))


def make_schedule(
    num_requests: int, rate: float, prompt_len: int, output_len: int, prefix_groups: int, prefix_len: int,
    len_spread: float, seed: int,
) -> list[WorkItem]:  # fmt: skip
    """Poisson arrivals at `rate` per second; prompts of a shared prefix (one of `prefix_groups`,
    `prefix_len` tokens; none when there are no groups) and a unique suffix of >= MIN_SUFFIX tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(prefix_groups)]
    items, arrival_s = [], 0.0
    for index in range(num_requests):
        arrival_s += rng.expovariate(rate)
        group = rng.randrange(prefix_groups) if prefix_groups else -1
        prefix = prefixes[group] if prefix_groups else []
        suffix_len = max(MIN_SUFFIX, _bounded(rng, prompt_len, len_spread) - len(prefix))
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(suffix_len)]
        items.append(WorkItem(index, arrival_s, group, prompt, _bounded(rng, output_len, len_spread)))
    return items


# ------------------------------------------------------------------ the fault schedule


class Fault(NamedTuple):
    action: str  # "kill" | "restart"
    node: str  # prefill0, decode1, ...
    at_s: float  # after the run's start


def parse_fault(action: str, text: str) -> Fault:
    """`NODE@SECONDS`, e.g. `prefill0@3`."""
    node, sep, at = text.partition("@")
    try:
        at_s = float(at)
    except ValueError:
        at_s = math.nan
    if not sep or not re.fullmatch(r"(prefill|decode)\d+", node) or not at_s >= 0:
        raise ValueError(f"--{action} {text!r}: write NODE@SECONDS, e.g. prefill0@3 or decode1@2.5")
    return Fault(action, node, at_s)


def check_faults(faults: list[Fault], node_names: list[str]) -> list[Fault]:
    """The faults in time order; raises ValueError for an unknown node, a kill of a node that is
    down or a restart of one that is up."""
    ordered = sorted(faults, key=lambda f: (f.at_s, f.action != "kill"))
    down: set[str] = set()
    for fault in ordered:
        if fault.node not in node_names:
            raise ValueError(f"--{fault.action} {fault.node}: no such node; the nodes are {', '.join(node_names)}")
        if (fault.action == "kill") == (fault.node in down):
            state = "already down" if fault.node in down else "not down"
            raise ValueError(f"--{fault.action} {fault.node}@{fault.at_s:g}: {fault.node} is {state} then")
        down ^= {fault.node}
    return ordered


def fault_window(events: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(first kill, last restarted node healthy); the end is inf while a node stays down."""
    kills = [e["at_s"] for e in events if e["action"] == "kill"]
    if not kills:
        return None
    down, end = set(), 0.0
    for event in events:
        if event["action"] == "kill":
            down.add(event["node"])
        elif event.get("healthy_at_s") is not None:
            down.discard(event["node"])
            end = max(end, event["healthy_at_s"])
    return min(kills), math.inf if down else end


def window_of(sent_s: float, end_s: float, window: tuple[float, float]) -> str:
    """`before` the fault: ended before it began; `after`: sent once it was over; else `during`."""
    begin, end = window
    if end_s <= begin:
        return "before"
    return "after" if sent_s >= end else "during"


# ------------------------------------------------------------------ figures


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q % of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize_ms(seconds: list[float]) -> dict[str, float | int | None]:
    if not seconds:
        return {"n": 0, "p50": None, "p99": None, "mean": None}
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "mean": sum(ms) / len(ms)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------ the client


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds after the run's start."""

    item: WorkItem
    sent_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    end_s: float = 0.0
    error_kind: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """From the scheduled arrival: waiting for a slot under the cap, or a late client, counts."""
        return self.token_times[0] - self.item.arrival_s if self.token_times else None

    @property
    def ttft_from_send_s(self) -> float | None:
        """From the moment it was sent: what the proxy and the nodes took."""
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:  # the first failure is the cause
            self.error_kind, self.error = kind, message[:300]


async def stream_completion(session: aiohttp.ClientSession, url: str, item: WorkItem, t0: float) -> Outcome:
    outcome = Outcome(item, sent_s=time.perf_counter() - t0)
    body = {"prompt": item.prompt_token_ids, "max_tokens": item.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    done = False
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                outcome.fail(f"http_{resp.status}", await resp.text())
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":  # read on to the end: leaving early looks like a hang-up to the proxy
                        done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        outcome.fail("stream_error", json.dumps(chunk["error"]))
                    tokens = chunk.get("choices", [{}])[0].get("token_ids") or []
                    if tokens:
                        outcome.token_times.append(time.perf_counter() - t0)
                        outcome.token_ids.extend(tokens)
    except asyncio.TimeoutError:
        outcome.fail("timeout", "no complete answer within --request-timeout")
    except (aiohttp.ClientError, ValueError) as exc:
        outcome.fail("connection", f"{type(exc).__name__}: {exc}")
    outcome.end_s = time.perf_counter() - t0
    if not done or len(outcome.token_ids) != item.max_tokens:
        outcome.fail("incomplete", f"{len(outcome.token_ids)} of {item.max_tokens} tokens, [DONE] {'seen' if done else 'missing'}")
    return outcome


@dataclass
class ClientStats:
    max_in_flight: int
    peak_in_flight: int = 0
    num_waited_for_slot: int = 0  # arrivals the in-flight cap held back
    send_lags_s: list[float] = field(default_factory=list)  # scheduled arrival -> sent


async def drive(url: str, schedule: list[WorkItem], max_in_flight: int, timeout_s: float, faults) -> tuple:
    """Send the schedule open loop while `faults(t0)` runs; returns (outcomes, client stats, fault events)."""
    stats, slots, in_flight = ClientStats(max_in_flight), asyncio.Semaphore(max_in_flight), 0

    async def one(item: WorkItem) -> Outcome:
        nonlocal in_flight
        stats.num_waited_for_slot += slots.locked()
        async with slots:
            in_flight += 1
            stats.peak_in_flight = max(stats.peak_in_flight, in_flight)
            try:
                outcome = await stream_completion(session, url, item, t0)
            finally:
                in_flight -= 1
        stats.send_lags_s.append(outcome.sent_s - item.arrival_s)
        return outcome

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        fault_task = asyncio.create_task(faults(t0))
        tasks = []
        for item in schedule:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
            tasks.append(asyncio.create_task(one(item)))
        outcomes = await asyncio.gather(*tasks)
        events = await fault_task
    return outcomes, stats, events


async def inject_faults(faults: list[Fault], procs: dict[str, ManagedProcess], t0: float, timeout_s: float) -> list:
    """Kill and restart nodes on schedule (on the main thread: see launcher.py); each restart's
    event gets `healthy_at_s` once the node answers /health again."""
    events, recoveries = [], []
    for fault in faults:
        await asyncio.sleep(max(0.0, t0 + fault.at_s - time.perf_counter()))
        proc = procs[fault.node]
        if fault.action == "kill":
            proc.kill()
        else:
            proc.restart()
        events.append({"action": fault.action, "node": fault.node, "at_s": time.perf_counter() - t0})
        if fault.action == "restart":
            recoveries.append(asyncio.create_task(_await_healthy(proc, events[-1], t0, timeout_s)))
    await asyncio.gather(*recoveries)
    return events


async def _await_healthy(proc: ManagedProcess, event: dict[str, Any], t0: float, timeout_s: float) -> None:
    event["healthy_at_s"] = None
    deadline = time.perf_counter() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while proc.is_running() and time.perf_counter() < deadline:
            try:
                async with session.get(f"{proc.url}/health") as resp:
                    if resp.status == 200:
                        event["healthy_at_s"] = time.perf_counter() - t0
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    event["error"] = f"not healthy after restart; log {proc.log_path}:\n{proc.log_tail(1000)}"


# ------------------------------------------------------------------ the nodes


def proxy_routings() -> list[str]:
    """The `--routing` choices `kvbridge proxy --help` lists; empty when it has no such flag."""
    help_text = subprocess.run(cli_argv("proxy", "--help"), capture_output=True, text=True, timeout=120).stdout
    match = re.search(r"--routing \{([^}]*)\}", help_text)
    return match.group(1).split(",") if match else []


def scrape(url: str) -> dict[str, float]:
    """`GET /metrics` as {sample name with labels: value}; {} when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        status, text = http_json(f"{url}/metrics", timeout_s=30)
    except OSError:
        return {}
    if status != 200 or not isinstance(text, str):
        return {}
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith(("_bucket", "_created")):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                    samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    except ValueError:  # a router whose /metrics is not Prometheus text (vllm-router serves its own elsewhere)
        return {}
    return samples


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much a node's counter grew; a node restarted in between counts from its restart (from 0)."""
    old, new = before.get(name, 0.0), after.get(name, 0.0)
    return new - old if new >= old else new


def prefix_hit_rate(before: dict[str, dict], after: dict[str, dict], nodes: list[str]) -> dict[str, Any]:
    """Prompt tokens the prefix caches of `nodes` served over all their prompt tokens, in one run."""
    cached, prompt = "kvbridge_cached_prompt_tokens_total", "kvbridge_prompt_tokens_total"
    per_node = {n: (counter_delta(before[n], after[n], cached), counter_delta(before[n], after[n], prompt)) for n in nodes}
    num_cached, num_prompt = sum(c for c, _ in per_node.values()), sum(p for _, p in per_node.values())
    return {"overall": ratio(num_cached, num_prompt), "per_node": {n: ratio(c, p) for n, (c, p) in per_node.items()}}


def node_state(url: str) -> dict[str, Any] | None:
    try:
        status, body = http_json(f"{url}/v1/kvbridge/state", timeout_s=30)
    except OSError:
        return None
    return body if status == 200 and isinstance(body, dict) else None


def settle(node_urls: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Poll every node until none holds a block or a request; what is left after `timeout_s` leaked."""
    start = time.monotonic()
    while True:
        states = {name: node_state(url) for name, url in node_urls.items()}
        nodes = {name: _holdings(state) for name, state in states.items()}
        busy = [n for n, h in nodes.items() if h["reachable"] and (h["num_used_blocks"] or h["has_unfinished_requests"])]
        if not busy or time.monotonic() - start > timeout_s:
            break
        time.sleep(0.5)
    leaked = busy + [n for n, h in nodes.items() if h["reachable"] and not h["integrity_ok"]]
    return {"ok": not leaked, "leaking_nodes": leaked, "settle_s": time.monotonic() - start, "nodes": nodes}


def _holdings(state: dict[str, Any] | None) -> dict[str, Any]:
    if state is None:
        return {"reachable": False}
    stats = state["stats"]
    return {
        "reachable": True,
        "num_used_blocks": stats["num_used_blocks"],
        "num_leased_requests": stats.get("connector", {}).get("scheduler", {}).get("num_leased_requests"),
        "has_unfinished_requests": state["has_unfinished_requests"],
        "integrity_ok": state["integrity"]["ok"],
    }


def warm_up(prefill_urls: list[str], decode_urls: list[str]) -> None:
    """One request over each prefill -> decode pair, both legs by hand (the proxy's protocol), so
    every NIXL handshake happens before the clock runs."""
    prompt = [random.Random(-1).randrange(VOCAB) for _ in range(64)]
    for p in prefill_urls:
        for d in decode_urls:
            leg = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
            status, prefill = http_json(f"{p}/v1/completions", leg)
            if status == 200:
                kv = {**(prefill["kv_transfer_params"] or {}), "do_remote_prefill": True}
                status, prefill = http_json(f"{d}/v1/completions", {**leg, "max_tokens": 2, "kv_transfer_params": kv})
            if status != 200:
                raise RuntimeError(f"warm-up {p} -> {d} failed with HTTP {status}: {prefill}")


def reset_prefix_caches(urls: list[str]) -> None:
    for url in urls:
        status, body = http_json(f"{url}/v1/kvbridge/reset_prefix_cache", {}, timeout_s=60)
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache of {url} failed with HTTP {status}: {body}")


def reference_tokens(model: str, schedule: list[WorkItem]) -> list[list[int]]:
    """Greedy tokens of one colocated engine without a connector, in this process."""
    from kvbridge import LLM, SamplingParams

    params = [SamplingParams(max_tokens=i.max_tokens, temperature=0.0, ignore_eos=True) for i in schedule]
    with LLM(model=model, max_model_len=max(len(i.prompt_token_ids) + i.max_tokens for i in schedule)) as llm:
        outputs = llm.generate([{"prompt_token_ids": i.prompt_token_ids} for i in schedule], params)
    return [out.outputs[0].token_ids for out in outputs]


# ------------------------------------------------------------------ one run, the report


def outcome_summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """Latencies of the requests that completed; the others counted by error kind."""
    ok = [o for o in outcomes if o.error_kind is None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error_kind is not None:
            errors[o.error_kind] = errors.get(o.error_kind, 0) + 1
    return {
        "num_requests": len(outcomes),
        "num_ok": len(ok),
        "num_errors": len(outcomes) - len(ok),
        "errors_by_kind": errors,
        "ttft_ms": summarize_ms([o.ttft_s for o in ok]),
        "ttft_from_send_ms": summarize_ms([o.ttft_from_send_s for o in ok]),
        "itl_ms": summarize_ms([gap for o in ok for gap in o.itls_s]),
        "e2e_ms": summarize_ms([o.end_s - o.item.arrival_s for o in ok]),
    }


def fault_report(events: list[dict[str, Any]], outcomes: list[Outcome]) -> dict[str, Any] | None:
    window = fault_window(events)
    if window is None:
        return None
    groups: dict[str, list[Outcome]] = {"before": [], "during": [], "after": []}
    for o in outcomes:
        groups[window_of(o.sent_s, o.end_s, window)].append(o)
    windows = {name: {k: v for k, v in outcome_summary(group).items() if k != "itl_ms"} for name, group in groups.items()}
    return {"events": events, "window_s": [window[0], None if math.isinf(window[1]) else window[1]], "windows": windows}


def run_once(args, proxy_url: str, schedule: list[WorkItem], reference, procs, node_urls, prefill_names, faults) -> dict:
    """One pass of the schedule through the proxy at `proxy_url`; the nodes settle afterwards."""
    counters_before = {name: scrape(url) for name, url in node_urls.items()}
    load_start = os.getloadavg()

    async def faults_now(t0: float) -> list:
        return await inject_faults(faults, procs, t0, args.startup_timeout)

    outcomes, client, events = asyncio.run(
        drive(proxy_url, schedule, args.max_in_flight, args.request_timeout, faults_now)
    )
    load_end = os.getloadavg()
    counters_after = {name: scrape(url) for name, url in node_urls.items()}
    try:
        proxy_health = http_json(f"{proxy_url}/health", timeout_s=30)[1]
    except OSError as exc:
        proxy_health = f"unreachable: {exc}"
    summary = outcome_summary(outcomes)
    ok = [o for o in outcomes if o.error_kind is None]
    wrong = [o.item.index for o in ok if o.token_ids != reference[o.item.index]] if reference else None
    span_s = max(o.end_s for o in outcomes) - schedule[0].arrival_s
    return {
        **summary,
        "duration_s": span_s,
        "offered_rate": len(schedule) / schedule[-1].arrival_s,
        "achieved_rate": len(ok) / span_s,
        "error_samples": [f"#{o.item.index} {o.error_kind}: {o.error}" for o in outcomes if o.error_kind][:NUM_SAMPLES],
        "wrong_completions": None if wrong is None else len(wrong),
        "wrong_samples": None if wrong is None else wrong[:NUM_SAMPLES],
        "client": {
            "max_in_flight": client.max_in_flight,
            "peak_in_flight": client.peak_in_flight,
            "num_waited_for_slot": client.num_waited_for_slot,
            "send_lag_ms": summarize_ms(client.send_lags_s),
        },
        "prefill_prefix_hit_rate": prefix_hit_rate(counters_before, counters_after, prefill_names),
        "ok_requests_per_node": {
            n: counter_delta(counters_before[n], counters_after[n], "kvbridge_requests_total{outcome=ok}") for n in node_urls
        },
        "faults": fault_report(events, outcomes),
        "leaks": settle(node_urls, args.settle_timeout),
        "proxy": {"health": proxy_health, "metrics": scrape(proxy_url)},
        "load_average": {"start": load_start, "end": load_end},
    }


def routing_plan(requested: str, supported: list[str]) -> tuple[list[str | None], str | None]:
    """The routings to run (None: the proxy's own, without the flag) and a note when that is not
    what was asked."""
    wanted = {"both": list(ROUTINGS), "routers": [*ROUTINGS, *VLLM_ROUTER_ROUTINGS]}.get(requested, [requested])
    if all(r in [*supported, *VLLM_ROUTER_ROUTINGS] for r in wanted):
        return wanted, None
    listed = f"--routing {{{','.join(supported)}}}" if supported else "no --routing"
    return [None], (
        f"asked for {requested}, but kvbridge proxy --help lists {listed}: ran the proxy's own "
        "round-robin once, without the flag, so there is no baseline ratio"
    )


def problems_of(runs: dict[str, dict], faults: list[Fault]) -> list[str]:
    problems = []
    for label, r in runs.items():
        if not r["leaks"]["ok"]:
            problems.append(f"{label}: blocks or requests still held, or integrity failed, after settling: {r['leaks']['leaking_nodes']}")
        if r["wrong_completions"]:
            problems.append(f"{label}: {r['wrong_completions']} completions differ from the colocated engine's")
        if r["num_errors"] and not faults:
            problems.append(f"{label}: {r['num_errors']} requests failed without any fault: {r['errors_by_kind']}")
        for event in (r["faults"] or {}).get("events", []):
            if "error" in event:
                problems.append(f"{label}: {event['node']} {event['error']}")
    return problems


def run(args, faults: list[Fault]) -> dict:
    schedule = make_schedule(args.num_requests, args.rate, args.prompt_len, args.output_len, args.prefix_groups,
                             args.prefix_len, args.len_spread, args.seed)  # fmt: skip
    attached = args.proxy_url is not None
    plan, note = ([None], None) if attached else routing_plan(args.routing, proxy_routings())
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvbridge-serve-load-")
    os.makedirs(log_dir, exist_ok=True)
    procs: dict[str, ManagedProcess] = {}
    try:
        if attached:
            node_urls = {f"prefill{i}": u for i, u in enumerate(args.prefill_url)}
            node_urls |= {f"decode{i}": u for i, u in enumerate(args.decode_url)}
        else:
            with_events = any(r in VLLM_ROUTER_ROUTINGS for r in plan)  # kv_aware reads the prefill nodes' KV events
            for name in node_names(args):
                role = name.rstrip("0123456789")
                node_args = shlex.split(args.node_args) + (events_args(log_dir, name) if with_events and role == "prefill" else [])
                procs[name] = start_node(name, role, log_dir, args.model, node_args, NODE_ENV)
            node_urls = {name: proc.url for name, proc in procs.items()}
        reference = reference_tokens(args.model, schedule) if args.check else None  # while the nodes boot
        wait_healthy(list(procs.values()), args.startup_timeout)
        prefill_names = [n for n in node_urls if n.startswith("prefill")]
        decode_urls = [u for n, u in node_urls.items() if n.startswith("decode")]
        warm_up([node_urls[n] for n in prefill_names], decode_urls)
        runs = {}
        for routing, label in run_order(plan, args.rounds, "attached" if attached else "proxy-default"):
            if attached:
                runs[label] = run_once(args, args.proxy_url, schedule, reference, procs, node_urls, prefill_names, faults)
                continue
            down = [proc for proc in procs.values() if not proc.is_running()]  # killed in the last routing's run
            for proc in down:
                proc.restart()
            wait_healthy(down, args.startup_timeout)
            reset_prefix_caches(list(node_urls.values()))  # every routing starts cold
            if routing in VLLM_ROUTER_ROUTINGS:
                proxy = start_vllm_router({n: node_urls[n] for n in prefill_names}, decode_urls, log_dir,
                                          VLLM_ROUTER_ROUTINGS[routing], name=label)  # fmt: skip
            else:
                proxy = start_proxy([node_urls[n] for n in prefill_names], decode_urls, log_dir,
                                    extra_args=["--routing", routing] if routing else [], name=f"proxy-{label}")  # fmt: skip
            try:
                wait_healthy([proxy], args.startup_timeout)
                if routing not in VLLM_ROUTER_ROUTINGS:
                    wait_proxy_routes_to_all(proxy, args.startup_timeout)
                runs[label] = run_once(args, proxy.url, schedule, reference, procs, node_urls, prefill_names, faults)
            finally:
                proxy.stop()
    finally:
        for proc in procs.values():
            proc.signal_stop()  # all at once: they shut down in parallel
        for proc in procs.values():
            proc.stop()
    per_round = [_ratios(runs[f"{ROUTINGS[0]}{s}"], runs[f"{BASELINE_ROUTING}{s}"]) for s in _round_suffixes(args.rounds)
                 if f"{ROUTINGS[0]}{s}" in runs and f"{BASELINE_ROUTING}{s}" in runs]  # fmt: skip
    problems = problems_of(runs, faults)
    return {
        "benchmark": "serve_load",
        "ok": not problems,
        "problems": problems,
        "routing": {"requested": "attached" if attached else args.routing, "runs": list(runs), "note": note},
        "runs": runs,
        "baseline": BASELINE_ROUTING if per_round else None,
        "ratios": _median_ratios(per_round) if per_round else None,
        "ratios_per_round": per_round if len(per_round) > 1 else None,
        # Every other routing of the run against the same baseline (the vllm-router ones with --routing routers).
        "ratios_vs_round_robin": {
            label: _ratios(r, runs[BASELINE_ROUTING]) for label, r in runs.items() if label != BASELINE_ROUTING
        } if BASELINE_ROUTING in runs else None,
        "log_dir": log_dir,
        "params": {k: v for k, v in vars(args).items() if k != "json"}
        | {action: [f"{f.node}@{f.at_s:g}" for f in faults if f.action == action] for action in ("kill", "restart")},
        "machine": machine_info("cpu"),
        "versions": versions(),
    }


def _round_suffixes(rounds: int) -> list[str]:
    return [f"#{i + 1}" for i in range(rounds)] if rounds > 1 else [""]


def run_order(plan: list[str | None], rounds: int, unnamed: str) -> list[tuple[str | None, str]]:
    """(routing, label) of each run: the plan once a round, every other round backwards, so the
    machine's drift over time (other work on a shared machine) weighs on each routing alike.
    A routing of None (the proxy's own) is labelled `unnamed`."""
    order = []
    for i, suffix in enumerate(_round_suffixes(rounds)):
        for routing in plan if i % 2 == 0 else plan[::-1]:
            order.append((routing, f"{routing or unnamed}{suffix}"))
    return order


def _median_ratios(per_round: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each ratio's median over the rounds."""
    return {k: statistics.median(vs) if (vs := [r[k] for r in per_round if r[k] is not None]) else None for k in per_round[0]}


def _ratios(run: dict, baseline: dict) -> dict[str, float | None]:
    """load-prefix / round-robin: below 1 is better for latencies, above 1 for the hit rate."""
    return {
        "ttft_p50": ratio(run["ttft_ms"]["p50"], baseline["ttft_ms"]["p50"]),
        "ttft_p99": ratio(run["ttft_ms"]["p99"], baseline["ttft_ms"]["p99"]),
        "itl_p50": ratio(run["itl_ms"]["p50"], baseline["itl_ms"]["p50"]),
        "achieved_rate": ratio(run["achieved_rate"], baseline["achieved_rate"]),
        "prefill_prefix_hit_rate": ratio(
            run["prefill_prefix_hit_rate"]["overall"], baseline["prefill_prefix_hit_rate"]["overall"]
        ),
    }


def print_summary(result: dict, out) -> None:
    def ms(figure: dict) -> str:
        return "-" if figure["n"] == 0 else f"p50 {figure['p50']:.1f} / p99 {figure['p99']:.1f} / mean {figure['mean']:.1f} ms"

    for label, r in result["runs"].items():
        wrong = "" if r["wrong_completions"] is None else f", {r['wrong_completions']} wrong"
        out.write(f"[{label}] {r['num_ok']}/{r['num_requests']} ok in {r['duration_s']:.1f} s: "
                  f"{r['achieved_rate']:.2f} req/s of {r['offered_rate']:.2f} offered{wrong}\n")  # fmt: skip
        out.write(f"  TTFT {ms(r['ttft_ms'])} (from send: {ms(r['ttft_from_send_ms'])}); ITL {ms(r['itl_ms'])}\n")
        hit_rate = r["prefill_prefix_hit_rate"]["overall"]
        out.write(f"  errors {r['errors_by_kind'] or 'none'}; prefill prefix hit rate {'-' if hit_rate is None else f'{hit_rate:.3f}'}\n")
        out.write(f"  client: peak {r['client']['peak_in_flight']} in flight, {r['client']['num_waited_for_slot']} held by the cap\n")
        for name, w in ((r["faults"] or {}).get("windows") or {}).items():
            out.write(f"  {name:>6} fault: {w['num_ok']}/{w['num_requests']} ok, errors {w['errors_by_kind'] or 'none'}, "
                      f"TTFT {ms(w['ttft_ms'])} (from send: {ms(w['ttft_from_send_ms'])})\n")  # fmt: skip
        leaks = r["leaks"]
        out.write(f"  leaks: {'none' if leaks['ok'] else leaks['leaking_nodes']} (settled in {leaks['settle_s']:.1f} s)\n")
    if result["ratios"]:
        ratios = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in result["ratios"].items())
        out.write(f"load-prefix / round-robin: {ratios}\n")
    if result["routing"]["note"]:
        out.write(f"note: {result['routing']['note']}\n")
    out.write("OK\n" if result["ok"] else "PROBLEMS:\n" + "".join(f"  {p}\n" for p in result["problems"]))


def node_names(args) -> list[str]:
    return [f"prefill{i}" for i in range(args.prefill)] + [f"decode{i}" for i in range(args.decode)]


def _fault_arg(action: str):
    def parse(text: str) -> Fault:
        try:
            return parse_fault(action, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    load = parser.add_argument_group("load")
    load.add_argument("--rate", type=float, default=6.0, help="mean arrivals per second (Poisson)")
    load.add_argument("--num-requests", type=int, default=1000)
    load.add_argument("--max-in-flight", type=int, default=256, help="safety cap on requests in flight")
    load.add_argument("--prompt-len", type=int, default=512, help="mean prompt tokens, prefix included")
    load.add_argument("--output-len", type=int, default=32, help="mean generated tokens")
    load.add_argument("--len-spread", type=float, default=0.5, help="lengths are uniform in mean * [1 - s, 1 + s]")
    load.add_argument("--prefix-groups", type=int, default=32, help="shared prefixes prompts are drawn from (0: none)")
    load.add_argument("--prefix-len", type=int, default=384, help="tokens of each shared prefix")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--check", action="store_true", help="compare each completion with a colocated engine's")
    nodes = parser.add_argument_group("nodes")
    nodes.add_argument("--prefill", type=int, default=2, help="prefill nodes to start")
    nodes.add_argument("--decode", type=int, default=2, help="decode nodes to start")
    nodes.add_argument("--model", default="tiny")
    nodes.add_argument("--node-args", default=NODE_ARGS, help="more `kvbridge serve` arguments, one string")
    nodes.add_argument("--routing", choices=[*ROUTINGS, *VLLM_ROUTER_ROUTINGS, "both", "routers"], default="both",
                       help="the proxy's --routing, or vllm-router with a prefill policy; both: the proxy's two, "
                       "routers: those and vllm-router's kv_aware and round_robin, on the same schedule")  # fmt: skip
    nodes.add_argument("--rounds", type=int, default=1,
                       help="run the routings this many times, every other round in reverse order (ABBA)")  # fmt: skip
    nodes.add_argument("--startup-timeout", type=float, default=180.0)
    nodes.add_argument("--settle-timeout", type=float, default=60.0, help="seconds the nodes get to free every block")
    nodes.add_argument("--log-dir", help="keep the nodes' and proxies' logs here (default: a new temporary directory)")
    nodes.add_argument("--proxy-url", help="attach to this running proxy instead of starting one")
    nodes.add_argument("--prefill-url", nargs="+", default=[], help="with --proxy-url: its prefill nodes")
    nodes.add_argument("--decode-url", nargs="+", default=[], help="with --proxy-url: its decode nodes")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--kill", action="append", default=[], metavar="NODE@S", type=_fault_arg("kill"),
                        help="SIGKILL a node S seconds after the first arrival (repeatable)")  # fmt: skip
    faults.add_argument("--restart", action="append", default=[], metavar="NODE@S", type=_fault_arg("restart"),
                        help="start a killed node again, same command and ports (repeatable)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.proxy_url is not None:
        if not (args.prefill_url and args.decode_url):
            parser.error("--proxy-url needs --prefill-url and --decode-url: the nodes whose blocks are checked")
        if args.kill or args.restart:
            parser.error("--kill/--restart need nodes this benchmark started; leave out --proxy-url")
        args.prefill, args.decode = len(args.prefill_url), len(args.decode_url)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        faults = check_faults(args.kill + args.restart, node_names(args))
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = run(args, faults)
    except NodeStartError as exc:
        sys.exit(f"serve_load: the nodes did not start: {exc}")
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print_summary(result, sys.stdout)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
