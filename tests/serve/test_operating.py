"""Operating a node, the proxy and the demo, black-box: real `kvbridge` processes on loopback.

What an operator sees: the help, the log lines (start-up progress, one per request, shutdown), and
user errors as one named line with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvbridge.transfer import nixl_build
from kvbridge.cli import build_parser
from kvbridge.serve import server
from kvbridge.serve.launcher import (
    HOST,
    ManagedProcess,
    cli_argv,
    free_ports,
    http_json,
    start_node,
    start_proxy,
    wait_healthy,
)

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")  # a logging line, not a message
DEMO_PROGRESS = re.compile(r"^kvbridge demo: \[ *[\d.]+ s\] ")
SECRET_PROMPT = "the prompt text must stay out of the logs"
needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None or not nixl_build.is_available(),
    reason="needs the NixlConnector",
)


def _run(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_argv(*args), check=False, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})}
    )


def _messages(stderr: str) -> list[str]:
    """What a command printed itself: stderr without log records and NIXL's own lines."""
    return [line for line in stderr.splitlines() if line and not LOG_RECORD.match(line) and not line.startswith(("[", "E1", "W1", "I1"))]


def _assert_one_named_error(proc: subprocess.CompletedProcess, prefix: str, *fragments: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    (line,) = [m for m in _messages(proc.stderr) if not DEMO_PROGRESS.match(m)]
    assert line.startswith(prefix), line
    for fragment in fragments:
        assert fragment in line, line


@contextlib.contextmanager
def _busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


def _wait_answering(proc: ManagedProcess, timeout_s: float = 60) -> None:
    """Until the process answers HTTP at all (a proxy over dead nodes answers /health with 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.is_running(), proc.log_tail()
        with contextlib.suppress(OSError):
            http_json(f"{proc.url}/health", timeout_s=2)
            return
        time.sleep(0.1)
    raise AssertionError(f"{proc.name} never answered; log:\n{proc.log_tail()}")


def _get(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


# ---------------------------------------------------------------------------------------- help


def test_top_level_help_says_what_the_tool_does_with_examples():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "moves an LLM's KV cache between inference engines" in proc.stdout
    assert "examples:" in proc.stdout and "kvbridge proxy --port 8000 --prefill" in proc.stdout


@pytest.mark.parametrize("command", ["generate", "serve", "proxy", "demo"])
def test_every_option_of_every_command_shows_its_default(command):
    parser = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)) or action.required:
            continue
        text = formatter._expand_help(action)
        assert "default" in text, f"{command} {action.option_strings}: {text!r}"
    assert "--log-level" in parser.format_help() and "KVBRIDGE_LOG_LEVEL" in parser.format_help()


def test_a_bad_log_level_in_the_environment_is_a_usage_error():
    proc = _run("proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", env={"KVBRIDGE_LOG_LEVEL": "loud"})
    assert proc.returncode == 2 and "KVBRIDGE_LOG_LEVEL='LOUD'; expected one of DEBUG, INFO, WARNING, ERROR" in proc.stderr


@pytest.mark.parametrize("name, value", [("KVBRIDGE_NIXL_PROGRESS_DELAY_US", "abc"), ("KVBRIDGE_FLUSH_TIMEOUT_S", "1s")])
def test_a_malformed_number_in_the_environment_is_a_usage_error(name, value):
    proc = _run("serve", "--role", "prefill", env={name: value})
    assert proc.returncode == 2, proc.stderr
    assert f"environment variable {name}={value!r} is not a number" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "nope"], ["ModelNotFoundError", "'nope'", "hf download <repo> --local-dir"]),
        (["--num-blocks", "1"], ["ConfigError: --num-blocks must be at least 2"]),
        (["--memory-fraction", "2"], ["--memory-fraction must be in (0, 0.95]"]),
        # refused by the engine while it is built, after the port is bound: still the flag, still 2
        (["--max-model-len", "99999"], ["engine start-up failed: ConfigError: --max-model-len 99999 exceeds"]),
    ],
    ids=["no-such-model", "num-blocks", "memory-fraction", "max-model-len"],
)
def test_serve_user_errors_are_one_named_line_with_exit_code_2(args, fragments):
    (port,) = free_ports(1)
    proc = _run("serve", "--no-connector", "--port", str(port), *args)
    _assert_one_named_error(proc, "kvbridge serve: ", *fragments)


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_a_busy_port_fails_at_once_with_exit_code_2(command):
    nodes = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"] if command == "proxy" else []
    with _busy_port() as port:
        t0 = time.monotonic()
        proc = _run(command, "--port", str(port), *nodes)
        elapsed = time.monotonic() - t0
    _assert_one_named_error(proc, f"kvbridge {command}: PortInUseError", f"port {port} on 127.0.0.1 is in use")
    assert "ready" not in proc.stderr
    assert elapsed < 15, f"took {elapsed:.1f} s"  # no engine built, no node checked first


@pytest.mark.nixl
@needs_nixl
def test_nixl_backend_error_comes_with_a_ucx_tls_hint():
    (port,) = free_ports(1)
    proc = _run("serve", "--role", "prefill", "--port", str(port), "--num-blocks", "8", env={"UCX_TLS": "sm,self"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [m for m in _messages(proc.stderr) if m.startswith("kvbridge serve:")]
    assert "NixlNotAvailableError" in line and "NIXL_ERR_BACKEND" in line, line
    assert "(UCX_TLS=sm,self)" in line and "UCX_TLS=tcp,self,sm" in line, line


def test_demo_with_a_bad_model_is_one_named_line_with_exit_code_2():
    proc = _run("demo", "--model", "nope", "--no-connector", "--startup-timeout", "60")
    _assert_one_named_error(proc, "kvbridge demo: ModelNotFoundError", "'nope'")


# ---------------------------------------------------------------------------------------- logs


@needs_nixl
def test_node_logs_start_up_each_request_and_shutdown_but_no_secret():
    token = "s3cret-admin-token"
    with tempfile.TemporaryDirectory(prefix="kvbridge-ops-") as log_dir:
        token_file = os.path.join(log_dir, "token")
        with open(token_file, "w") as f:
            f.write(token)
        node = start_node("node", "both", log_dir, extra_args=["--num-threads", "1", "--admin-token-file", token_file])
        try:
            wait_healthy([node], timeout_s=120)
            body = {"prompt": SECRET_PROMPT, "max_tokens": 2, "temperature": 0}
            request = urllib.request.Request(
                f"{node.url}/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-Request-Id": "trace-42"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=60) as resp:
                assert resp.status == 200
            assert _get(f"{node.url}/v1/kvbridge/state", {"Authorization": f"Bearer {token}"}) == 200
            assert _get(f"{node.url}/nope", {}) == 404
        finally:
            assert node.stop() == 0
        with open(node.log_path) as f:
            log = f.read()
    side_channel_port = node.argv[node.argv.index("--side-channel-port") + 1]
    for expected in (
        "weights loaded: tiny (tiny:seed=0, float32 on cpu)",
        # the default size on CPU: 8192 tokens = 512 blocks of the tiny preset's 32 KiB
        "KV cache: 512 blocks of 16 tokens, 16777216 bytes (16.0 MiB) on cpu; the default of 8192 tokens",
        f"side channel on tcp://127.0.0.1:{side_channel_port}",
        "connector NixlConnector ready: role kv_both",
        f"kvbridge serve: ready: role=both, NixlConnector/kv_both on {node.url}",
        "INFO kvbridge.access: POST /v1/completions 200 ",
        "request_id='trace-42'",
        "INFO kvbridge.access: GET /v1/kvbridge/state 200 ",
        "INFO kvbridge.access: GET /nope 404 ",
        "SIGTERM: stopping",
        "INFO kvbridge.serve.server: stopped",
    ):
        assert expected in log, f"{expected!r} not in the log:\n{log}"
    assert "kvbridge.access: GET /health" not in log  # probes are logged at DEBUG only
    assert SECRET_PROMPT not in log and token not in log


def _proxy_log(log_dir: str, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> str:
    """Start a proxy over nodes that do not exist, send it one completion and one bad route, stop it."""
    proxy = start_proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], log_dir, extra_args=extra_args, env=env)
    try:
        _wait_answering(proxy)
        status, _ = http_json(f"{proxy.url}/v1/completions", {"prompt": SECRET_PROMPT})
        assert status == 503  # no healthy decode node
        assert _get(f"{proxy.url}/nope", {"X-Request-Id": "trace-7"}) == 404
    finally:
        assert proxy.stop() == 0
    with open(proxy.log_path) as f:
        return f.read()


def test_proxy_logs_each_request_and_its_level_follows_the_flag_then_the_environment():
    with tempfile.TemporaryDirectory(prefix="kvbridge-ops-") as log_dir:
        log = _proxy_log(log_dir)
        assert log.index("kvbridge proxy: ready on") < log.index("POST /v1/completions 503"), log
        assert "INFO kvbridge.access: GET /nope 404 " in log and "request_id='trace-7'" in log, log
        assert "INFO kvbridge.serve.proxy: SIGTERM: stopping" in log and SECRET_PROMPT not in log, log

        quiet = _proxy_log(log_dir, env={"KVBRIDGE_LOG_LEVEL": "warning"})
        assert "kvbridge.access" not in quiet and "kvbridge proxy: ready on" in quiet, quiet

        flag_wins = _proxy_log(log_dir, env={"KVBRIDGE_LOG_LEVEL": "WARNING"}, extra_args=("--log-level", "info"))
        assert "INFO kvbridge.access: POST /v1/completions 503 " in flag_wins, flag_wins


# ---------------------------------------------------------------------------------------- KV cache size


def test_a_cuda_node_sizes_its_kv_cache_from_memory_a_cpu_node_keeps_the_small_default():
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    cuda = server.build_engine_config(parser.parse_args(["--device", "cuda", "--no-connector"])).cache
    assert (cuda.num_blocks, cuda.memory_fraction) == (None, server.DEFAULT_CUDA_MEMORY_FRACTION)
    cpu = server.build_engine_config(parser.parse_args(["--no-connector"])).cache
    assert (cpu.num_blocks, cpu.memory_fraction) == (None, None)  # the engine's 8192 tokens
    given = server.build_engine_config(parser.parse_args(["--device", "cuda", "--num-blocks", "64", "--no-connector"]))
    assert (given.cache.num_blocks, given.cache.memory_fraction) == (64, None)


# ---------------------------------------------------------------------------------------- demo


def _five_free_ports() -> int:
    """A base port whose next 4 ports were free a moment ago too."""
    for _ in range(50):
        (base,) = free_ports(1)
        if base + 4 >= 65536:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + 5):
                    stack.enter_context(socket.socket()).bind((HOST, port))
            except OSError:
                continue
        return base
    raise AssertionError("no 5 consecutive free ports")


def test_demo_reports_progress_pins_ports_and_keeps_logs():
    base = _five_free_ports()
    with tempfile.TemporaryDirectory(prefix="kvbridge-ops-") as log_dir:
        demo_logs = os.path.join(log_dir, "demo")
        proc = _run(
            "demo", "--no-connector", "--num-prompts", "1", "--max-tokens", "2", "--log-dir", demo_logs,
            "--base-port", str(base), timeout_s=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        progress = _messages(proc.stderr)
        for name, port in (("prefill0", base + 1), ("decode0", base + 3), ("proxy", base)):
            assert any(f"starting {name} on http://127.0.0.1:{port} (log: {demo_logs}/{name}.log)" in m for m in progress), progress
            assert any(m.endswith(f"{name} is ready") for m in progress), progress
        assert progress[-1] == f"kvbridge demo: the processes' logs are in {demo_logs}", progress
        assert sorted(os.listdir(demo_logs)) == ["decode0.log", "prefill0.log", "proxy.log"]
        with open(os.path.join(demo_logs, "decode0.log")) as f:
            decode_log = f.read()
        assert "weights loaded" in decode_log and "POST /v1/completions 200" in decode_log, decode_log
    assert "1 requests" in proc.stdout and "all completions match" in proc.stdout, proc.stdout
