"""Helpers of the end-to-end tests of KVBridgeConnector inside real vLLM servers (test_adapter_*.py).

    config = kvbridge_transfer_config("kv_consumer", "NixlConnector", policy="recompute", lease_s=30)
    server = vllm_servers.start("decode", model, kv_transfer_config=config)
    prompt = random_prompt(seed=3, num_tokens=300)          # BOS, then no special token
    totals = wait_for_metrics(server.url, lambda m: m.get(TRANSFERS, 0) >= 1)

kvbridge's statistics reach vLLM's /metrics as gauges `kvbridge_<side>_<path>` (the adapter's
stats.py); they are running totals, so a test scrapes before and after and compares.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from vllm_client import scrape_metrics

from kvbridge.serve.launcher import http_json

# Gauges of the NixlConnector (worker half) and of the adapter, as vLLM's /metrics names them.
TRANSFERS = "kvbridge_worker_num_transfers"
BYTES = "kvbridge_worker_bytes_transferred"
FAILURES = "kvbridge_worker_num_failures"
LOAD_ERRORS = "kvbridge_worker_num_load_errors"
LEASES = "kvbridge_worker_num_leases"
EXPIRED_LEASES = "kvbridge_worker_num_expired_leases"
MISMATCHED = "kvbridge_scheduler_num_mismatched_params"
UNPROVEN = "kvbridge_scheduler_num_unproven_addresses"  # params naming an address the prefill did not vouch for
OFFERS_TAKEN = "kvbridge_scheduler_num_offers_taken"  # decode requests sent at once whose prefill offered the params
HELD = "kvbridge_scheduler_adapter_held_requests"
TRACKED = "kvbridge_scheduler_adapter_tracked_requests"


def kvbridge_transfer_config(role: str, connector: str, *, policy: str = "recompute", **options: Any) -> dict[str, Any]:
    """`--kv-transfer-config` loading kvbridge's `connector` through KVBridgeConnector.

    `options` are the connector's own (and KVTransferConfig's side_channel_*/flush_timeout_s);
    `policy` is vLLM's kv_load_failure_policy ("recompute" or "fail", vLLM's default).
    """
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"connector": connector, **options},
    }


def random_prompt(seed: int, num_tokens: int, vocab_size: int = 1024) -> list[int]:
    """BOS, then `num_tokens - 1` ids past the special tokens: a prompt no other seed shares a block with."""
    rng = random.Random(seed)
    return [0, *(rng.randrange(3, vocab_size) for _ in range(num_tokens - 1))]


def greedy(prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A completion body: greedy, exactly `max_tokens` tokens."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def kvbridge_metrics(url: str) -> dict[str, float]:
    return scrape_metrics(url, prefixes=("kvbridge_",))


def wait_for_metrics(url: str, is_done: Callable[[dict[str, float]], bool], timeout_s: float = 10.0) -> dict[str, float]:
    """The server's kvbridge gauges once `is_done(gauges)` holds, or the last ones after `timeout_s`.

    Statistics reach /metrics a little after the request that changed them has answered (vLLM's
    output handler runs after the response), so a test waits for the value it expects, then asserts.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = kvbridge_metrics(url)
        if is_done(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def reset_prefix_cache(url: str, timeout_s: float = 15.0) -> int:
    """POST /reset_prefix_cache until vLLM reports success; returns the attempts it took.

    Its worker runs in a process of its own (vLLM's CPU backend with multiprocessing), so the adapter
    cannot drain it first: vLLM refuses while an offload store still holds blocks, and a retry succeeds.
    """
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        status, body = http_json(f"{url}/reset_prefix_cache", {})
        assert status == 200, (status, body)
        if body.get("success") or time.monotonic() > deadline:
            assert body.get("success"), f"vLLM did not reset its prefix cache in {timeout_s} s: {body}"
            return attempts
        time.sleep(0.2)
