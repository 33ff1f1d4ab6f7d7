"""docs/benchmarks.md's tables are made from the kept benchmark JSON (benchmarks/results.py), never
typed by hand, and a kept result shows its headline figures, date, commit, machine and command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "results.py"


def load_results_module():
    spec = importlib.util.spec_from_file_location("benchmark_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_tables_are_what_the_kept_results_make():
    proc = subprocess.run([sys.executable, str(SCRIPT), "render", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, f"run `python benchmarks/results.py render`: {proc.stderr}"


def test_a_kept_result_becomes_a_table_of_its_headline_figures():
    results = load_results_module()
    result = {
        "benchmark": "decode_step",
        "step_ms": {"1": 4.25, "32": 9.5},
        "fraction_of_limit": {"1": 0.71234, "32": 0.6},
        "baseline": "memory-bandwidth limit",
        "batches": {"1": {"graphs": {"median_ms": 4.25}}},  # nested detail: not a headline
        "machine": {"cpu": "Some CPU", "cpu_count": 16, "gpus": ["NVIDIA H200"]},
        "versions": {"torch": "2.11.0", "nixl": "1.5.1"},
        "recorded": {"date": "2026-12-01", "commit": "abc1234", "command": "python benchmarks/decode_step.py --json"},
    }
    text = results.table("decode_step-h200", result)
    assert "| fraction_of_limit [1] | 0.7123 |" in text and "| step_ms [32] | 9.5 |" in text
    assert "| baseline | memory-bandwidth limit |" in text and "batches" not in text
    assert "2026-12-01, commit `abc1234`; 1 × NVIDIA H200; Some CPU, 16 cores; torch 2.11.0, nixl 1.5.1" in text
    assert "python benchmarks/decode_step.py --json" in text


def test_the_last_json_object_is_read_past_log_lines():
    results = load_results_module()
    assert results.last_json_object('loading {weights}\n{"a": 1}\nnoise\n{"b": {"c": 2}}\n') == {"b": {"c": 2}}


def test_a_nested_result_shows_the_leaves_its_benchmark_names():
    results = load_results_module()
    result = {"benchmark": "vllm_pd", "arms": {"kvbridge": {"by_prompt_len": {"1024": {
        "ttft_s": {"p50": 0.11, "p99": 0.12, "min": 0.1}, "transfer": {"gb_per_s": 56.9, "latency_gauges_ms": {"p90": 12.4}},
    }}}}}  # fmt: skip
    rows = dict(results.headlines(result))
    assert rows == {"arms.kvbridge.by_prompt_len.1024.ttft_s.p50": "0.11", "arms.kvbridge.by_prompt_len.1024.ttft_s.p99": "0.12",
                    "arms.kvbridge.by_prompt_len.1024.transfer.gb_per_s": "56.9"}  # fmt: skip
