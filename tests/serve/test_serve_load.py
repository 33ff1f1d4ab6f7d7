"""benchmarks/serve_load.py: its pure parts (arrivals, fault schedule, windows, percentiles), then one
tiny run end to end. Timings are never asserted; the run checks counts, tokens and leaks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import serve_load  # noqa: E402
from serve_load import Fault  # noqa: E402

SCHEDULE_ARGS = dict(num_requests=2000, rate=8.0, prompt_len=100, output_len=20, prefix_groups=4, prefix_len=64,
                     len_spread=0.5)  # fmt: skip


def test_the_schedule_is_seeded_and_poisson_at_the_rate():
    a, b = serve_load.make_schedule(**SCHEDULE_ARGS, seed=1), serve_load.make_schedule(**SCHEDULE_ARGS, seed=1)
    assert a == b and a != serve_load.make_schedule(**SCHEDULE_ARGS, seed=2)
    arrivals = [item.arrival_s for item in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len(a) / arrivals[-1] == pytest.approx(8.0, rel=0.1)  # 2,000 exponential gaps of mean 1/8
    gaps = [y - x for x, y in zip([0.0, *arrivals], arrivals)]
    assert sum(g < 1 / 8 for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.05)


def test_prompts_share_their_groups_prefix_and_lengths_stay_in_bounds():
    items = serve_load.make_schedule(**SCHEDULE_ARGS, seed=3)
    prefixes = {}
    for item in items:
        prefix = prefixes.setdefault(item.group, item.prompt_token_ids[:64])
        assert item.prompt_token_ids[:64] == prefix
        assert 64 + serve_load.MIN_SUFFIX <= len(item.prompt_token_ids) <= 150
        assert 10 <= item.max_tokens <= 30
        assert all(0 <= t < serve_load.VOCAB for t in item.prompt_token_ids)
    assert len(prefixes) == 4 and len({tuple(p) for p in prefixes.values()}) == 4
    assert sum(len(i.prompt_token_ids) for i in items) / len(items) == pytest.approx(100, rel=0.05)


def test_without_groups_no_prompt_shares_a_prefix():
    items = serve_load.make_schedule(**{**SCHEDULE_ARGS, "prefix_groups": 0, "num_requests": 50}, seed=0)
    assert {i.group for i in items} == {-1}
    assert len({tuple(i.prompt_token_ids[:16]) for i in items}) == 50


def test_parse_fault():
    assert serve_load.parse_fault("kill", "prefill0@3") == Fault("kill", "prefill0", 3.0)
    assert serve_load.parse_fault("restart", "decode12@2.5") == Fault("restart", "decode12", 2.5)
    for bad in ("prefill0", "prefill0@", "prefill0@-1", "proxy@3", "prefill@3", "decode1@nan", "@3"):
        with pytest.raises(ValueError, match="NODE@SECONDS"):
            serve_load.parse_fault("kill", bad)


def test_check_faults_orders_them_and_refuses_impossible_ones():
    names = ["prefill0", "prefill1", "decode0"]
    kill, restart = Fault("kill", "prefill0", 3.0), Fault("restart", "prefill0", 6.0)
    assert serve_load.check_faults([restart, kill], names) == [kill, restart]
    same_time = [Fault("restart", "prefill0", 3.0), Fault("kill", "prefill0", 3.0)]
    assert serve_load.check_faults(same_time, names)[0].action == "kill"
    with pytest.raises(ValueError, match="no such node; the nodes are prefill0, prefill1, decode0"):
        serve_load.check_faults([Fault("kill", "decode1", 1.0)], names)
    with pytest.raises(ValueError, match="prefill0 is not down then"):
        serve_load.check_faults([restart], names)
    with pytest.raises(ValueError, match="prefill0 is already down then"):
        serve_load.check_faults([kill, Fault("kill", "prefill0", 4.0)], names)


def test_fault_window_runs_from_the_first_kill_to_the_last_recovery():
    assert serve_load.fault_window([]) is None
    events = [
        {"action": "kill", "node": "prefill0", "at_s": 3.0},
        {"action": "kill", "node": "decode0", "at_s": 4.0},
        {"action": "restart", "node": "prefill0", "at_s": 6.0, "healthy_at_s": 9.0},
        {"action": "restart", "node": "decode0", "at_s": 7.0, "healthy_at_s": 8.0},
    ]
    assert serve_load.fault_window(events) == (3.0, 9.0)
    assert serve_load.fault_window(events[:3]) == (3.0, math.inf)  # decode0 stays down
    never_healthy = [events[0], {**events[2], "healthy_at_s": None}]
    assert serve_load.fault_window(never_healthy) == (3.0, math.inf)


def test_a_request_is_before_during_or_after_the_fault():
    window = (3.0, 9.0)
    assert serve_load.window_of(1.0, 3.0, window) == "before"
    assert serve_load.window_of(1.0, 3.5, window) == "during"  # in flight when the node died
    assert serve_load.window_of(8.0, 10.0, window) == "during"
    assert serve_load.window_of(9.0, 10.0, window) == "after"
    assert serve_load.window_of(20.0, 21.0, (3.0, math.inf)) == "during"


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert serve_load.percentile(values, 50) == 50.0 and serve_load.percentile(values, 99) == 99.0
    assert serve_load.percentile([5.0, 1.0, 3.0], 50) == 3.0 and serve_load.percentile([2.0], 99) == 2.0
    assert serve_load.summarize_ms([0.001, 0.003]) == {"n": 2, "p50": 1.0, "p99": 3.0, "mean": 2.0}
    assert serve_load.summarize_ms([])["p50"] is None


def test_routing_plan_falls_back_to_the_proxys_own_round_robin():
    assert serve_load.routing_plan("both", ["load-prefix", "round-robin"]) == (["load-prefix", "round-robin"], None)
    assert serve_load.routing_plan("round-robin", ["load-prefix", "round-robin"]) == (["round-robin"], None)
    plan, note = serve_load.routing_plan("both", [])
    assert plan == [None] and "lists no --routing" in note


def test_rounds_alternate_the_order_of_the_routings():
    plan = ["load-prefix", "round-robin"]
    assert serve_load.run_order(plan, 1, "x") == [("load-prefix", "load-prefix"), ("round-robin", "round-robin")]
    assert [label for _, label in serve_load.run_order(plan, 3, "x")] == [
        "load-prefix#1", "round-robin#1", "round-robin#2", "load-prefix#2", "load-prefix#3", "round-robin#3",
    ]  # fmt: skip
    assert serve_load.run_order([None], 2, "attached") == [(None, "attached#1"), (None, "attached#2")]


def test_prefix_hit_rate_counts_a_restarted_node_from_its_restart():
    names = ("kvbridge_cached_prompt_tokens_total", "kvbridge_prompt_tokens_total")
    before = {"prefill0": dict(zip(names, (10.0, 100.0))), "prefill1": dict(zip(names, (50.0, 100.0)))}
    after = {"prefill0": dict(zip(names, (40.0, 200.0))), "prefill1": dict(zip(names, (30.0, 60.0)))}
    rate = serve_load.prefix_hit_rate(before, after, ["prefill0", "prefill1"])
    assert rate["per_node"] == {"prefill0": 0.3, "prefill1": 0.5}
    assert rate["overall"] == pytest.approx(60 / 160)


@pytest.mark.nixl
@pytest.mark.slow
def test_a_tiny_run_completes_every_request_correctly_and_leaks_nothing():
    argv = [sys.executable, str(BENCHMARKS / "serve_load.py"), "--json", "--prefill", "1", "--decode", "1",
            "--num-requests", "20", "--rate", "10", "--prompt-len", "96", "--prefix-len", "48", "--prefix-groups", "2",
            "--output-len", "8", "--routing", "round-robin", "--check"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads(proc.stdout)
    (run,) = result["runs"].values()
    assert result["ok"] and result["problems"] == []
    assert run["num_ok"] == 20 and run["errors_by_kind"] == {} and run["wrong_completions"] == 0
    assert run["ttft_ms"]["n"] == 20 and run["itl_ms"]["n"] > 0
    assert run["leaks"]["ok"] and all(n["num_used_blocks"] == 0 for n in run["leaks"]["nodes"].values())
    assert run["faults"] is None and result["params"]["num_requests"] == 20
