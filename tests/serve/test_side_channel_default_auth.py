"""Authenticated by default: nodes started with no secret configured share this user's host secret, so
P/D between them works with no setting, while a process without it, a plain ZMQ client or a process
of another Unix user on the same host, learns nothing from the side channel (no engine identity, no
compat hash, no NIXL metadata) and cannot release a lease."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import zmq

from kvbridge.serve.launcher import free_ports, http_json, start_node, wait_healthy
from kvbridge.transfer import messages as m

pytestmark = pytest.mark.nixl

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "64", "--max-model-len", "256", "--flush-timeout", "1"]
# A decode node that gives up on a peer in a second (a connection it should never have made fails fast).
DECODE_ARGS = [*NODE_ARGS, "--kv-connector-extra", '{"handshake_timeout_s": 1.0, "handshake_retries": 0}']
PROMPT = "Nobody without the secret touches this prompt's KV cache. " * 2
OTHER_PROMPT = "Nor may a plain client release the lease on this one. " * 2
PORT_PROMPT = "Nor point the decode node at a port of its own choosing. " * 2
NOBODY_UID = 65534


def _plain_request(address: str, msg: m.Message) -> m.Message | None:
    """One unsigned frame, as any process of the host could send it; the decoded answer, or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(m.encode_frame(m.Frame(7, m.encode(msg))))
        if not sock.poll(5000):
            return None
        frame = m.decode_frame(sock.recv())
        assert not frame.mac, "the node signed its answer to a frame it could not verify"
        return m.decode(frame.payload)
    finally:
        sock.close(0)


@pytest.fixture(scope="module")
def nodes():
    """A prefill and a decode node of this user, neither told of a secret, on a private runtime directory."""
    with tempfile.TemporaryDirectory() as log_dir, tempfile.TemporaryDirectory() as runtime:
        os.chmod(runtime, 0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")} | {"XDG_RUNTIME_DIR": runtime}
        ports = tuple(free_ports(2))  # HTTP, side channel
        procs = [start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS, env=env, ports=ports)]
        procs.append(start_node("decode", "decode", log_dir, extra_args=DECODE_ARGS, env=env))
        try:
            wait_healthy(procs, 120)
            yield procs, Path(runtime), f"tcp://127.0.0.1:{ports[1]}"
        finally:
            for proc in procs:
                proc.stop()


def _prefill(url: str, prompt: str = PROMPT) -> dict:
    status, body = http_json(f"{url}/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True},
    })  # fmt: skip
    assert status == 200, body
    return body["kv_transfer_params"]


def _decode(url: str, params: dict, prompt: str = PROMPT) -> tuple[int, dict]:
    return http_json(f"{url}/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "kv_transfer_params": {**params, "do_remote_prefill": True},
    })  # fmt: skip


def test_pd_between_one_users_nodes_needs_no_setting_and_the_secret_file_is_private(nodes):
    (prefill, decode), runtime, _ = nodes
    params = _prefill(prefill.url)
    status, body = _decode(decode.url, params)
    assert status == 200, body
    assert body["kvbridge"]["num_external_tokens"] > 0, f"the decode node recomputed instead of pulling: {body}"
    secret = runtime / "kvbridge" / "side-channel-secret"
    assert (secret.stat().st_mode & 0o777, (runtime / "kvbridge").stat().st_mode & 0o777) == (0o600, 0o700)
    assert len(secret.read_bytes().strip()) >= 32


def test_a_plain_client_learns_nothing(nodes):
    (prefill, decode), _, _ = nodes
    params = _prefill(prefill.url, OTHER_PROMPT)
    address = f"tcp://{params['remote_host']}:{params['remote_port']}"
    probes = [
        m.Ping(engine_id="probe"),  # unauthenticated: would say who answers
        # a made-up compat hash: refused as incompatible, unauthenticated the refusal names the right one
        m.HandshakeRequest(protocol_version=m.PROTOCOL_VERSION, engine_id="probe", compat_hash="0" * 16),
        m.TransferDone(engine_id="probe", incarnation=params["remote_incarnation"], leases=[m.LeaseRef(
            req_id=params["remote_request_id"], token=params["remote_lease_token"],
            block_ids=params["remote_block_ids"], block_hash=params["remote_block_hash"],
        )]),  # even with the lease's params: a release needs the secret too
    ]  # fmt: skip
    for probe in probes:
        reply = _plain_request(address, probe)
        assert isinstance(reply, m.ErrorReply) and reply.code == m.ErrorCode.AUTH, f"{type(probe).__name__}: {reply}"
        assert params["remote_incarnation"] not in reply.message
    status, body = _decode(decode.url, params, OTHER_PROMPT)  # the refused release freed nothing: the lease is still read
    assert status == 200 and body["kvbridge"]["num_external_tokens"] > 0, body


def test_a_process_of_another_user_is_refused(nodes, tmp_path):
    """A process of uid nobody that resolves its side-channel secret as any node does gets its own host
    secret, and the prefill refuses it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    _, _, address = nodes
    script = tmp_path / "other_user.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from kvbridge.errors import AuthenticationError
        from kvbridge.transfer import messages as m
        from kvbridge.transfer.host_secret import runtime_dir, side_channel_secret
        from kvbridge.transfer.side_channel import SideChannelClient

        # Python lives under /root here: start as root, then become nobody before anything is resolved.
        os.setgroups([])
        os.setgid({NOBODY_UID})
        os.setuid({NOBODY_UID})
        client = SideChannelClient("{address}", side_channel_secret(),
                                   timeout_s=5.0, retries=0)
        try:
            reply = client.request(m.Ping(engine_id="other-user"))
            print("ANSWERED", reply)
        except AuthenticationError as e:
            print("REFUSED", runtime_dir(), e)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBRIDGE_", "XDG_"))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.startswith("REFUSED"), done.stdout + done.stderr
    assert f"kvbridge-{NOBODY_UID}" in done.stdout  # its own secret, not ours


class _Listener:
    """A local TCP service that is not kvbridge: counts the connections it accepts."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port, self.num_connections, self._stop = self._sock.getsockname()[1], 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = self._sock.accept()
                self.num_connections += 1
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def test_params_cannot_point_the_decode_node_at_another_local_port(nodes):
    """An HTTP client that puts a port of its choosing into real params (loopback, so inside the default
    allowed_peers), with the prefill's proof, a made-up one or none, makes the decode node connect nowhere:
    it connects only to an address the prefill vouched for with the secret. The prompt is computed there
    (the untouched params pull: the first test)."""
    (prefill, decode), _, _ = nodes
    listener = _Listener()
    try:
        for tamper in ({}, {"remote_address_mac": "0" * 64}, {"remote_address_mac": ""}):
            params = _prefill(prefill.url, PORT_PROMPT)
            status, body = _decode(decode.url, {**params, "remote_port": listener.port, **tamper}, PORT_PROMPT)
            assert status == 200, body
            assert body["kvbridge"]["num_external_tokens"] == 0, body
            assert "AuthenticationError" in body["kvbridge"]["kv_load_error"], body
    finally:
        listener.close()
    assert listener.num_connections == 0, f"the decode node connected {listener.num_connections} times to a port an API client named"
