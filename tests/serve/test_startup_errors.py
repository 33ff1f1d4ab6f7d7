"""What a user typed is what a command refuses or runs: `kvbridge serve` and `kvbridge proxy` as
processes, their exit codes and the flags their errors name.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile

import pytest

from kvbridge.serve.launcher import ManagedProcess, cli_argv, free_ports, http_json, wait_healthy

MULTI = {"connectors": [{"connector": "NixlConnector"}, {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 64}}]}


def _run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(*args), check=False, capture_output=True, text=True, timeout=timeout_s)


def _is_bound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


@pytest.mark.parametrize(
    ("flag", "urls"),
    [("--prefill", ["127.0.0.1:19100"]), ("--decode", ["localhost:19200"]), ("--decode", ["http://127.0.0.1:8200/v1"])],
)
def test_the_proxy_refuses_a_node_url_it_cannot_use_before_it_says_ready(flag, urls):
    prefill = urls if flag == "--prefill" else ["http://127.0.0.1:19100"]
    decode = urls if flag == "--decode" else ["http://127.0.0.1:19200"]
    (port,) = free_ports(1)
    proc = _run("proxy", "--port", str(port), "--prefill", *prefill, "--decode", *decode, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "ready" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert f"kvbridge proxy: ConfigError: {flag} '{urls[0]}' is not a node URL" in proc.stderr, proc.stderr


def test_a_model_directory_without_config_json_is_a_bad_flag():
    with tempfile.TemporaryDirectory() as empty:
        proc = _run("serve", "--model", empty, "--no-connector", "--port", str(free_ports(1)[0]))
    assert proc.returncode == 2, proc.stderr
    assert "has no config.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.nixl
@pytest.mark.slow
def test_side_channel_port_with_multiconnector_is_bound_and_a_busy_one_is_refused_naming_the_flag():
    """Issue 22, finding 1: the port was dropped and a random one bound. Then a second node asking
    for the same port exits 2 with an error naming --side-channel-port (was: exit 1, PeerUnreachableError)."""
    port, side_channel_port = free_ports(2)
    with tempfile.TemporaryDirectory() as log_dir:
        argv = cli_argv(
            "serve", "--role", "prefill", "--port", str(port), "--side-channel-port", str(side_channel_port),
            "--num-threads", "1", "--num-blocks", "64", "--kv-connector", "MultiConnector",
            "--kv-connector-extra", json.dumps(MULTI),
        )  # fmt: skip
        node = ManagedProcess("multi", f"http://127.0.0.1:{port}", argv, log_dir)
        try:
            wait_healthy([node], timeout_s=120)
            assert _is_bound(side_channel_port), node.log_tail()
            status, state = http_json(f"{node.url}/v1/kvbridge/state")
            assert status == 200 and str(side_channel_port) in json.dumps(state["stats"]), state
            # The same port for a second node (no --num-blocks: its log names the flags that size the cache).
            busy = _run("serve", "--role", "prefill", "--port", str(free_ports(1)[0]),
                        "--side-channel-port", str(side_channel_port), "--num-threads", "1")  # fmt: skip
        finally:
            assert node.stop() == 0
    assert busy.returncode == 2, busy.stderr
    assert "PortInUseError" in busy.stderr and f"--side-channel-port {side_channel_port}" in busy.stderr, busy.stderr
    assert "set --num-blocks or --memory-fraction to size it" in busy.stderr, busy.stderr
    assert "CacheConfig." not in busy.stderr and "KVTransferConfig." not in busy.stderr, busy.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--role", "decode", "--side-channel-port", "5701"],
        ["--kv-connector", "OffloadingConnector", "--side-channel-port", "5701"],
        ["--no-connector", "--side-channel-port", "5701"],
    ],
)
def test_a_side_channel_port_nothing_would_bind_is_refused_at_start(flags):
    proc = _run("serve", "--port", str(free_ports(1)[0]), *flags, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert "--side-channel-port" in proc.stderr and "ready" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_help_shows_no_side_channel_port_for_a_decode_node():
    proc = _run("--help", timeout_s=60)
    assert proc.returncode == 0
    decode_lines = [line for line in proc.stdout.splitlines() if "--role decode" in line]
    assert decode_lines and not any("--side-channel-port" in line for line in decode_lines), proc.stdout

