"""`kvbridge demo` end to end, as a user runs it: separate processes, NIXL over loopback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kvbridge.serve.demo import demo_prompts


def test_demo_prompts_mix_lengths_shared_prefixes_and_repeats():
    prompts = demo_prompts(7)
    assert len(prompts) == 7 and len(set(prompts)) == 6  # one exact repeat
    assert prompts[3].startswith(prompts[2]) and len(prompts[2]) > 5 * 16  # a long, partly cached prompt
    assert min(map(len, prompts)) <= 16 < max(map(len, prompts))  # under one block, and many blocks


@pytest.mark.nixl
@pytest.mark.skipif(
    importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
)
def test_demo_json_reports_matching_completions_and_bytes():
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "demo", "--json", "--num-prompts", "4", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 4 and summary["all_match"] is True and summary["num_failed"] == 0
    assert summary["bytes_transferred"] > 0
    assert summary["bytes_transferred"] == sum(r["kv_bytes"] for r in summary["per_request"])
    assert summary["decode_connector"].get("bytes_transferred", summary["bytes_transferred"]) >= summary["bytes_transferred"]
