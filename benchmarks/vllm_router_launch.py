"""vLLM's router (`vllm-router`, the Rust router on PyPI) in P/D mode in front of kvbridge nodes, for
serve_load.py: the router a fleet already runs, beside kvbridge's own proxy (docs/deploy.md).

    router = start_vllm_router(prefill_urls, decode_urls, log_dir, "kv_aware", events={url: endpoint})

`kv_aware` scores prefill nodes by the blocks they published in their KV events (`kvbridge serve
--kv-events-config`), hashing each prompt's token ids (it asks a node's `POST /tokenize`) as vLLM does.
"""

from __future__ import annotations

import json
import shutil

from kvbridge.serve.launcher import HOST, ManagedProcess, free_ports

# --routing names -> the router's prefill policy; decodes are picked round robin in both.
VLLM_ROUTER_ROUTINGS = {"vllm-router-kv-aware": "kv_aware", "vllm-router-round-robin": "round_robin"}


def events_endpoint(log_dir: str, node_name: str) -> str:
    """Where a prefill node publishes its KV events: an ipc:// socket it binds (nothing off the host)."""
    return f"ipc://{log_dir}/{node_name}.kv-events"


def events_args(log_dir: str, node_name: str) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint(log_dir, node_name)}
    return ["--kv-events-config", json.dumps(config)]


def start_vllm_router(
    prefill: dict[str, str], decode_urls: list[str], log_dir: str, policy: str, name: str = "vllm-router"
) -> ManagedProcess:
    """`vllm-router --vllm-pd-disaggregation` on a free loopback port; `prefill` maps node name -> URL
    (each publishing its events at `events_endpoint(log_dir, name)`, which kv_aware subscribes to)."""
    exe = shutil.which("vllm-router")
    if exe is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router (it is in kvbridge's dev extra)")
    (port,) = free_ports(1)
    argv = [exe, "--host", HOST, "--port", str(port), "--vllm-pd-disaggregation", "--prefill-policy", policy,
            "--decode-policy", "round_robin", "--log-level", "warning"]  # fmt: skip
    for node_name, url in prefill.items():
        argv += ["--prefill", url]
        if policy == "kv_aware":
            argv += ["--pd-kv-events", f"{url}={events_endpoint(log_dir, node_name)}"]
    for url in decode_urls:
        argv += ["--decode", url]
    return ManagedProcess(name, f"http://{HOST}:{port}", argv, log_dir)
