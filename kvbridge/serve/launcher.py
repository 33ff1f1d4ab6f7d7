"""Start node and proxy subprocesses on loopback, wait until they are healthy, always stop them.

Used by `kvbridge demo` and by the multi-process tests:

    with PDCluster(model="tiny", num_prefill=1, num_decode=1) as cluster:   # raises NodeStartError
        post_json(f"{cluster.proxy_url}/v1/completions", {"prompt": "hi"})
    # every child is stopped here: SIGTERM, then SIGKILL after a grace period

Children run `python -m kvbridge.cli serve|proxy ...` in their own session with their output in a
log file (never a pipe that could fill up and block them). On Linux they also get SIGTERM if the
process that started them dies (PR_SET_PDEATHSIG), so a killed demo leaves no orphans; start
them from a thread that lives as long as they should (the main thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.errors import NodeStartError

HOST = "127.0.0.1"


# Ports handed out for servers come from below the kernel's ephemeral range: a port there is never
# given to an outgoing connection, so none can take it between `free_ports` and the server's bind.
# (Ports from `bind(0)` are ephemeral ones; on a busy machine a client's connect() reused them.)
_SERVER_PORTS_FLOOR = 10_000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_random = random.SystemRandom()  # independent of any seed a test or user set with `random.seed`


def _server_port_range() -> range | None:
    """Ports that no outgoing connection is given (below the ephemeral range), or None if unknown."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(_SERVER_PORTS_FLOOR, first_ephemeral) if first_ephemeral - _SERVER_PORTS_FLOOR >= 1024 else None


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports that nobody listened on a moment ago, held open together while chosen.

    Where the kernel says which ports are ephemeral, they are drawn at random from below that range
    (see `_SERVER_PORTS_FLOOR`), else the kernel picks them."""
    candidates = _server_port_range()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            ports.append(_bind_free(sock, host, candidates))
        return ports


def _bind_free(sock: socket.socket, host: str, candidates: range | None) -> int:
    for _ in range(64 if candidates else 0):
        port = _random.choice(candidates)
        try:
            sock.bind((host, port))
            return port
        except OSError:  # in use (or lingering): try another
            continue
    sock.bind((host, 0))
    return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess:
    """One child process with its base URL and log file. `stop()` is idempotent."""

    def __init__(self, name: str, url: str, argv: list[str], log_dir: str, env: dict[str, str] | None = None):
        self.name, self.url, self.argv = name, url, argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._env = {**os.environ, **(env or {})}
        self.popen = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches us; we stop the children in order
            preexec_fn=_die_with_parent,
            env=self._env,
        )

    def is_running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - num_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def kill(self) -> int:
        """SIGKILL at once, as a crash would (fault injection); returns the exit code."""
        if self.is_running():
            self.popen.kill()
        return self.popen.wait(10)

    def restart(self) -> None:
        """Run the same command again, at the same address, once the process has ended (`kill()`,
        `stop()`); the new process appends to the same log. Call it from the thread that started
        the process (see the module docstring)."""
        if self.is_running():
            raise RuntimeError(f"{self.name} is still running; kill() or stop() it before restart()")
        if self._log.closed:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = self._spawn()

    def signal_stop(self) -> None:
        if self.is_running():
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL. Returns the exit code."""
        self.signal_stop()
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> tuple[int, Any]:
    """GET (body None) or POST JSON; returns (status, decoded JSON or text). Raises OSError when unreachable."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_healthy(
    procs: Sequence[ManagedProcess], timeout_s: float, on_ready: Callable[[ManagedProcess], None] | None = None
) -> None:
    """Wait until every process answers 200 on /health, calling `on_ready(proc)` as each does.
    Raises NodeStartError with its log tail."""
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if not proc.is_running():
                raise NodeStartError(
                    f"{proc.name} exited with code {proc.popen.returncode} before it was healthy; "
                    f"its log ({proc.log_path}) ends with:\n{proc.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if http_json(f"{proc.url}/health", timeout_s=2.0)[0] == 200:
                    pending.remove(proc)
                    if on_ready is not None:
                        on_ready(proc)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise NodeStartError(
                f"{names} not healthy after {timeout_s:.0f}s; raise the start-up timeout on a slow machine. "
                f"Log of {pending[0].name} ({pending[0].log_path}) ends with:\n{pending[0].log_tail()}"
            )
        if pending:
            time.sleep(0.1)


def wait_proxy_routes_to_all(proxy: ManagedProcess, timeout_s: float) -> None:
    """Wait until the proxy's /health says every node is in rotation (`"status": "ok"`): its health
    checks find a node a moment after the node answers its own /health. Raises NodeStartError."""
    deadline = time.monotonic() + timeout_s
    health: Any = "no answer"
    while True:
        with contextlib.suppress(OSError):
            status, health = http_json(f"{proxy.url}/health", timeout_s=2.0)
            if status == 200 and isinstance(health, dict) and health.get("status") == "ok":
                return
        if time.monotonic() > deadline:
            raise NodeStartError(f"{proxy.name} does not route to every node after {timeout_s:.0f}s: {health}")
        time.sleep(0.1)


def cli_argv(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvbridge.cli", command, *args]


def start_node(
    name: str, role: str, log_dir: str, model: str = "tiny", extra_args: Sequence[str] = (), env=None,
    ports: tuple[int, int] | None = None,
) -> ManagedProcess:
    """`kvbridge serve --role ROLE` on loopback `ports` (HTTP, side channel); default: free ones.

    Only a node that listens on a side channel (a prefill or both node with the default connector)
    gets `--side-channel-port`: any other refuses the flag. Passing the ports of a node that was
    killed restarts it at the same address.
    """
    port, side_channel_port = ports or free_ports(2)
    args = list(extra_args)
    connector = args[args.index("--kv-connector") + 1] if "--kv-connector" in args[:-1] else "NixlConnector"
    listens = role != "decode" and "--no-connector" not in args and connector == "NixlConnector"
    side_channel = ["--side-channel-port", str(side_channel_port)] if listens else []
    argv = cli_argv(
        "serve", "--role", role, "--host", HOST, "--port", str(port), *side_channel, "--model", model, *extra_args,
    )  # fmt: skip
    return ManagedProcess(name, f"http://{HOST}:{port}", argv, log_dir, env)


def start_proxy(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], log_dir: str, timeout_s: float = 120.0,
    extra_args: Sequence[str] = (), name: str = "proxy", port: int | None = None, env=None,
) -> ManagedProcess:
    """`kvbridge proxy` on loopback `port` (default: a free one); `extra_args` go to it as they are
    (e.g. `--routing`), `env` adds to its environment."""
    port = port or free_ports(1)[0]
    argv = cli_argv(
        "proxy", "--host", HOST, "--port", str(port), "--timeout", str(timeout_s),
        "--prefill", *prefill_urls, "--decode", *decode_urls, *extra_args,
    )  # fmt: skip
    return ManagedProcess(name, f"http://{HOST}:{port}", argv, log_dir, env)


class PDCluster:
    """`num_prefill` prefill nodes, `num_decode` decode nodes and a proxy over them, as processes.

    `node_args` go to every `kvbridge serve` (e.g. `["--num-blocks", "64"]`, or `["--no-connector"]`).
    Entering starts them and waits for health, the proxy's view of every node included (`start()` +
    `wait()` split the two, so a caller can work while they boot); leaving (or `stop()`) stops them
    all, whatever happened. With `base_port`, the ports are pinned (see `pinned_ports`), else free
    ones are picked; with `log_dir`, the logs are kept there, else in a directory removed at stop.
    """

    def __init__(self, model: str = "tiny", num_prefill: int = 1, num_decode: int = 1, node_args=(), env=None,
                 startup_timeout_s: float = 120.0, log_dir: str | None = None, base_port: int | None = None) -> None:  # fmt: skip
        self.model, self.num_prefill, self.num_decode = model, num_prefill, num_decode
        self.node_args, self.env, self.startup_timeout_s = list(node_args), env, startup_timeout_s
        self.base_port = base_port
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="kvbridge-cluster-")
        self.log_dir = log_dir or self._tmp.name
        self.prefill: list[ManagedProcess] = []
        self.decode: list[ManagedProcess] = []
        self.proxy: ManagedProcess | None = None

    @property
    def processes(self) -> list[ManagedProcess]:
        return self.prefill + self.decode + ([self.proxy] if self.proxy else [])

    @property
    def proxy_url(self) -> str:
        return self.proxy.url

    def pinned_ports(self) -> tuple[int | None, list[tuple[int, int] | None]]:
        """(proxy port, each node's (HTTP, side-channel) ports, prefill nodes first). From `base_port`:
        the proxy's, then two per node in order; without it, None everywhere (free ports)."""
        num_nodes = self.num_prefill + self.num_decode
        if self.base_port is None:
            return None, [None] * num_nodes
        base = self.base_port
        return base, [(base + 1 + 2 * i, base + 2 + 2 * i) for i in range(num_nodes)]

    def start(self, on_start: Callable[[ManagedProcess], None] | None = None) -> PDCluster:
        """Start every process (`on_start(proc)` after each), the proxy last."""
        proxy_port, node_ports = self.pinned_ports()
        roles = [("prefill", i, self.prefill) for i in range(self.num_prefill)]
        roles += [("decode", i, self.decode) for i in range(self.num_decode)]
        try:
            for (role, i, nodes), ports in zip(roles, node_ports):
                nodes.append(start_node(f"{role}{i}", role, self.log_dir, self.model, self.node_args, self.env, ports))
                if on_start is not None:
                    on_start(nodes[-1])
            self.proxy = start_proxy(
                [p.url for p in self.prefill], [d.url for d in self.decode], self.log_dir, port=proxy_port
            )
            if on_start is not None:
                on_start(self.proxy)
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, on_ready: Callable[[ManagedProcess], None] | None = None) -> None:
        """Wait until every process is healthy (`on_ready(proc)` as each is) and the proxy routes to all."""
        try:
            wait_healthy(self.processes, self.startup_timeout_s, on_ready)
            wait_proxy_routes_to_all(self.proxy, self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in self.processes:
            proc.signal_stop()  # all at once: they shut down in parallel
        for proc in self.processes:
            proc.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PDCluster:
        self.start()
        self.wait()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
