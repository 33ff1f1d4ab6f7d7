"""KVBridgeConnector in vLLM's in-process `LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0): reset and shutdown.

Each test runs `inprocess_llm.py` in a subprocess of the vLLM environment's python and checks the
JSON it prints, so vLLM's process-wide state never leaks into pytest or into the next test.

* A prefix-cache reset that comes while an offload store is still in flight waits for the store
  (the adapter drains its worker) and succeeds; vLLM alone answers False while any block is held.
  The same prompt is then served from kvbridge's host tier with the same greedy tokens.
* Create -> generate -> shut down, NixlConnector and OffloadingConnector in turn, in one process:
  vLLM calls the adapter's shutdown, every kvbridge thread ends, NIXL agents are dropped and every
  registration of vLLM's KV buffer is undone, RSS stays flat.

(The in-process prefill whose reset waits for a decode server's read is in test_adapter_pd.py,
next to that server.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("inprocess_llm.py")
BLOCK_SIZE = 128
NUM_CYCLES = 6  # NixlConnector and OffloadingConnector three times each; cycles 0-1 warm the process up
MAX_RSS_GROWTH = 64 << 20  # over the cycles after the warm-up pair (a leaked 1 GiB KV buffer fails it at once)


def run_script(*args: str, timeout_s: float = 300.0) -> list[dict]:
    """The JSON lines `inprocess_llm.py ARGS` prints (NIXL logs to stdout too: other lines are skipped)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"{SCRIPT.name} {args[0]} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
    for record in records:
        print(record)
    return records


def test_reset_during_offload_store_waits_for_it_and_next_request_loads_from_host_tier(tiny_checkpoint):
    (out,) = run_script("offload-reset", tiny_checkpoint)

    assert out["first_cached_tokens"] == 0
    # The store was in flight when the reset came (each store sleeps store_delay_s): the reset waited.
    assert out["reset_s"] >= out["store_delay_s"] / 2, out
    assert out["reset"] is True, "vLLM refused the reset: the adapter did not drain the store in flight"
    # vLLM's prefix cache is empty now: the 3 full blocks come from kvbridge's host tier.
    assert out["second_cached_tokens"] == out["num_prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert out["second"] == out["first"]
    assert len(out["first"]) == 8


def test_create_generate_shutdown_cycles_leave_no_threads_memory_or_registrations(tiny_checkpoint):
    before, *cycles = run_script("cycles", tiny_checkpoint, str(NUM_CYCLES))
    assert len(cycles) == NUM_CYCLES
    warm, last = cycles[1], cycles[-1]

    assert len({tuple(c["tokens"]) for c in cycles}) == 1, "greedy tokens differ between cycles"
    for c in cycles:
        assert any(t.startswith("kvbridge") for t in c["threads_running"]), c  # it ran kvbridge's threads...
        leftover = [t for t in c["threads"] if t.startswith("kvbridge")]
        assert not leftover, f"cycle {c['cycle']} ({c['connector']}) left threads running: {leftover}"
        # vLLM 0.32 shuts down both instances (worker: ensure_kv_transfer_shutdown; scheduler: Scheduler.shutdown)
        assert c["connector_shutdowns"] == 2 * (c["cycle"] + 1), c
        assert c["nixl_agents_alive"] == 0, f"cycle {c['cycle']}: a NIXL agent outlived its engine"
        assert c["nixl_deregistered"] == c["nixl_registered"], f"cycle {c['cycle']}: NIXL registrations left: {c}"
    assert last["nixl_registered"] >= NUM_CYCLES // 2  # every NixlConnector cycle registered vLLM's KV buffer
    assert last["threads"] == warm["threads"]
    assert last["num_os_threads"] == warm["num_os_threads"], (before, warm, last)
    growth = last["rss"] - warm["rss"]
    print(f"RSS: {before['rss'] >> 20} MiB before, {warm['rss'] >> 20} after 2 cycles, {last['rss'] >> 20} after "
          f"{NUM_CYCLES}: +{growth / 2**20:.1f} MiB over {NUM_CYCLES - 2} cycles; "
          f"OS threads {warm['num_os_threads']} after 2 cycles, {last['num_os_threads']} after {NUM_CYCLES}")  # fmt: skip
    assert growth < MAX_RSS_GROWTH
