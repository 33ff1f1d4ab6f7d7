"""What every chaos scenario shares: node processes on loopback, reference completions, an HTTP
client, and the two checks each scenario ends with (the attacker's sockets: chaos_sockets.py).

The checks (issue 9): (a) no completion with wrong tokens is ever returned: a 200 carries exactly
the greedy tokens of a colocated engine for its prompt (`assert_correct`), a clear JSON error
passes where the scenario allows it; (b) nothing leaks: every live node's state reaches
`num_used_blocks == 0` with integrity ok and `/health` is 200 (`assert_clean`).

The attacker only uses what a client of the HTTP API or of the side channel can: the
`kv_transfer_params` that a prefill node returns for its own prompts, and bytes on sockets.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
import time
from typing import Any

from chaos_sockets import side_channel_address, side_channel_message

from kvbridge import LLM, SamplingParams
from kvbridge.errors import NodeStartError
from kvbridge.serve.launcher import ManagedProcess, free_ports, http_json, start_node, wait_healthy

NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_TOKENS = 6
NODE_ARGS = ["--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN)]
# A decode node that gives up on an unreachable or bogus peer in seconds, not in a minute.
FAST_FAIL = {"handshake_timeout_s": 1.0, "handshake_retries": 0, "transfer_timeout_s": 5.0}
REQUEST_TIMEOUT_S = 60.0  # a deadline that detects a hang, never a performance bound
CLEAN_TIMEOUT_S = 45.0  # leases of 30 s (the default) expire well inside it
STARTUP_TIMEOUT_S = 120.0
# What a scenario does not set itself is off, whatever the shell running the tests exports: open
# admin endpoints (the suite resets caches and reads state) and no side-channel secret (see `start`).
NODE_ENV = {"KVBRIDGE_ADMIN_TOKEN": "", "KVBRIDGE_SIDE_CHANNEL_SECRET": ""}

_WORDS = (
    "amber basalt cobalt delta ember fjord garnet harbor indigo jasper kelp lagoon meadow nickel "
    "onyx prism quartz raven sierra tundra umber violet willow xenon yarrow zephyr"
).split()


# ---------------------------------------------------------------- prompts and references


def prompt(tag: str, num_chars: int = 180) -> str:
    """A deterministic prompt of about `num_chars` bytes (= tokens) that starts with `tag`.

    Distinct tags give prompts that differ in their first block, so they never share cached KV.
    """
    rng = random.Random(hashlib.sha256(tag.encode()).digest())
    text = f"[{tag}]"
    while len(text) < num_chars:
        text += " " + rng.choice(_WORDS)
    return text[:num_chars]


def references(prompts: list[str], max_tokens: int = MAX_TOKENS) -> dict[str, list[int]]:
    """Greedy completions of a colocated engine (no connector) for each prompt."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    unique = list(dict.fromkeys(prompts))
    with LLM(max_model_len=MAX_MODEL_LEN) as llm:
        outputs = llm.generate(unique, params)
    return {p: out.outputs[0].token_ids for p, out in zip(unique, outputs)}


# ---------------------------------------------------------------- node processes


class NodeSet:
    """The node processes of one test module, by name. `close()` stops every one of them.

    Each node gets its ports up front, so `kill` + `start(..., ports=nodes.ports(name))` restarts
    it at the same HTTP and side-channel address.
    """

    def __init__(self) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="kvbridge-chaos-")
        self.procs: dict[str, ManagedProcess] = {}
        self.refs: dict[str, list[int]] = {}  # the module's reference completions, by prompt
        self._ports: dict[str, tuple[int, int]] = {}
        self._all: list[ManagedProcess] = []
        self._redraw: dict[str, tuple[str, list[str], dict[str, str] | None] | None] = {}

    def start(self, name: str, role: str, extra: list[str] = (), env: dict[str, str] | None = None,
              ports: tuple[int, int] | None = None) -> ManagedProcess:  # fmt: skip
        self._redraw[name] = (role, list(extra), env) if ports is None else None  # its own ports: redrawn if taken
        ports = ports or tuple(free_ports(2))
        env = {**NODE_ENV, **(env or {})}
        # Without a configured secret the suite's nodes run unauthenticated, as its attackers speak unsigned
        # raw frames: they stand for any holder of the host's secret, whom only lease tokens and digests stop.
        connector = extra[extra.index("--kv-connector") + 1] if "--kv-connector" in extra[:-1] else "NixlConnector"
        nixl = connector == "NixlConnector" and "--no-connector" not in extra  # the one that takes the flag
        insecure = ["--insecure-side-channel"] if nixl and not env["KVBRIDGE_SIDE_CHANNEL_SECRET"] else []
        proc = start_node(name, role, self.log_dir, "tiny", [*NODE_ARGS, *insecure, *extra], env, ports=ports)
        self.procs[name], self._ports[name] = proc, ports
        self._all.append(proc)
        return proc

    def url(self, name: str) -> str:
        return self.procs[name].url

    def ports(self, name: str) -> tuple[int, int]:
        """(HTTP port, side-channel port) of the node."""
        return self._ports[name]

    def side_channel(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self._ports[name][1]}"

    def pid(self, name: str) -> int:
        return self.procs[name].popen.pid

    def wait(self, *names: str) -> None:
        """Until every node (or those named) is healthy. A node whose ports the harness drew and that
        exited because another process took one of them in the meantime (tests run side by side) is
        started again on fresh ports, at most twice; a node restarted on given ports never is."""
        for attempt in range(3):
            try:
                return wait_healthy([self.procs[n] for n in names or self.procs], STARTUP_TIMEOUT_S)
            except NodeStartError:
                taken = [n for n in names or list(self.procs) if self._redraw.get(n) and not self.procs[n].is_running()
                         and "PortInUseError" in self.procs[n].log_tail()]  # fmt: skip
                if attempt == 2 or not taken:
                    raise
                for name in taken:
                    self.start(name, *self._redraw[name])

    def kill(self, name: str) -> None:
        """SIGKILL: the process dies holding whatever it held, as in a crash."""
        proc = self.procs.pop(name)
        proc.popen.kill()
        proc.popen.wait(10)

    def close(self) -> None:
        for proc in self._all:
            proc.signal_stop()
        for proc in self._all:
            proc.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------- HTTP client


def request(url: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = REQUEST_TIMEOUT_S):
    """(status, JSON or text) of one request; a hang past `timeout_s` fails the test by name."""
    try:
        return http_json(f"{url}{path}", body, timeout_s=timeout_s)
    except OSError as e:
        raise AssertionError(f"{url}{path} gave no answer within {timeout_s:.0f}s (a hang?): {e!r}") from None


def metric(url: str, name: str) -> float:
    """The value of the unlabelled sample `name` on `url`'s /metrics; a missing one fails the test by name."""
    status, text = request(url, "/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on {url}/metrics")


def complete(url: str, text: str, params: dict[str, Any] | None = None, max_tokens: int = MAX_TOKENS,
             timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:  # fmt: skip
    body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return request(url, "/v1/completions", body, timeout_s)


def prefill(url: str, text: str) -> dict[str, Any]:
    """The kv_transfer_params a prefill node returns for `text` (it now holds the prompt's blocks)."""
    status, body = complete(url, text, {"do_remote_decode": True}, max_tokens=1)
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params and params["remote_block_ids"], body
    return {**params, "do_remote_prefill": True}


def wait_granted(params: dict) -> None:
    """Renew the lease (as its requester may) until the prefill says "held": it has been granted, and
    the blocks digested, so what is written from now on is written after the digest."""
    lease = {k: params[f"remote_{k}"] for k in ("block_ids", "block_hash")}
    lease |= {"req_id": params["remote_request_id"], "token": params["remote_lease_token"]}
    renew = {"type": "lease2", "engine_id": "client", "incarnation": params["remote_incarnation"], "leases": [lease]}
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        reply = side_channel_message(side_channel_address(params), renew)
        assert reply is not None and reply["type"] == "lease2_ok", reply
        if reply.get("held") == [lease["req_id"]]:
            return
        assert reply.get("pending") == [lease["req_id"]], reply
        assert time.monotonic() < deadline, "the prefill never granted the lease"
        time.sleep(0.05)


def assert_correct(status: int, body: Any, expected: list[int], allow_error: bool = True) -> None:
    """A 200 carries exactly `expected`; anything else must be a clear JSON error (if allowed)."""
    if status == 200:
        got = body["choices"][0]["token_ids"]
        assert got == expected, f"WRONG TOKENS served with 200: got {got}, the colocated engine gives {expected}"
        return
    assert allow_error, f"expected 200 with the correct tokens, got {status}: {body}"
    assert 400 <= status < 600 and isinstance(body, dict), f"not a JSON error: {status} {body!r}"
    assert body.get("error", {}).get("message"), f"error without a message: {status} {body}"


def assert_refused(status: int, body: Any, field: str) -> None:
    """HTTP 400 with an OpenAI-shaped error that blames kv_transfer_params and names `field`."""
    assert status == 400, f"expected 400 naming {field}, got {status}: {body}"
    error = body["error"]
    assert error["param"] == "kv_transfer_params" and field in error["message"], body


def external_tokens(body: Any) -> int:
    return body["kvbridge"]["num_external_tokens"]


def assert_no_remote_kv(status: int, body: Any) -> None:
    """A 200 for params that cannot prove the blocks are this prompt's used no remote KV at all.

    Stronger than the tokens alone: a tiny random model often falls into the same few tokens, so
    another prompt's KV can happen to give the right ones.
    """
    if status == 200:
        assert external_tokens(body) == 0, (
            f"served {external_tokens(body)} tokens of remote KV that nothing proves is this prompt's"
        )


def state(url: str) -> dict[str, Any]:
    status, body = request(url, "/v1/kvbridge/state", timeout_s=30)
    assert status == 200, body
    return body


def load_errors(url: str) -> int:
    """Blocks the node's connector reported as not loaded (the engine's load-error counter)."""
    return state(url)["stats"]["num_failed_load_blocks"]


def assert_healthy(url: str) -> None:
    status, body = request(url, "/health", timeout_s=10)
    assert status == 200, f"{url} is not healthy: {status} {body}"


def assert_clean(*urls: str, timeout_s: float = CLEAN_TIMEOUT_S) -> None:
    """Each node: healthy, integrity ok, no request left, and (within `timeout_s`) no block in use."""
    for url in urls:
        assert_healthy(url)
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while True:
        states = {url: state(url) for url in pending}
        for url, s in states.items():
            assert s["integrity"]["ok"], f"{url}: integrity check failed: {s['integrity']}"
        pending = [u for u, s in states.items() if s["stats"]["num_used_blocks"] or s["has_unfinished_requests"]]
        if not pending:
            return
        if time.monotonic() > deadline:
            leaks = {u: (states[u]["stats"]["num_used_blocks"], states[u]["stats"].get("connector")) for u in pending}
            raise AssertionError(f"blocks still in use after {timeout_s:.0f}s (leaked?): {leaks}")
        time.sleep(0.25)


def churn(url: str, tag: str, num_blocks: int = NUM_BLOCKS) -> None:
    """Plain prompts through a node until every one of its blocks has been rewritten.

    Blocks that a lease holds stay untouched; free ones (cached or not) are all reused.
    """
    per_prompt = (MAX_MODEL_LEN - 2 * BLOCK_SIZE) // BLOCK_SIZE  # full blocks of one filler prompt
    for i in range(num_blocks // per_prompt + 2):
        status, body = complete(url, prompt(f"{tag}-churn{i}", per_prompt * BLOCK_SIZE + 4), max_tokens=1)
        assert status == 200, body


# ---------------------------------------------------------------- processes


def num_threads(pid: int) -> int:
    """Threads of a live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")


def free_port() -> int:
    """A loopback port nobody listens on (free a moment ago)."""
    return free_ports(1)[0]
