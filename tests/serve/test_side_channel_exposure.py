"""Readers cannot write: a node never serves its side channel off loopback without a secret (a
handshake hands out what lets its holder write into the KV cache), unless told it is insecure, and a
secret too short to resist guessing is refused by name at start-up."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from kvbridge.errors import ConfigError
from kvbridge.serve.launcher import cli_argv, free_ports
from kvbridge.transfer.auth import check_exposure, is_loopback

# TEST-NET-1 (RFC 5737): an address that is not loopback; the node refuses before binding anything there.
NOT_LOOPBACK = "192.0.2.1"


def test_a_prefill_node_with_a_short_secret_refuses_to_start():
    http_port, side_port = free_ports(2)
    argv = cli_argv(
        "serve", "--role", "prefill", "--port", str(http_port), "--side-channel-port", str(side_port),
        "--num-blocks", "16", "--num-threads", "1",
    )  # fmt: skip
    env = {**_plain_env(), "KVBRIDGE_SIDE_CHANNEL_SECRET": "x" * 31}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode != 0, done.stderr
    assert "KVBRIDGE_SIDE_CHANNEL_SECRET is 31 bytes long" in done.stderr and "at least 32" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr  # a named error, not a crash


def test_the_rule_and_its_explicit_override(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.10") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback(NOT_LOOPBACK) and not is_loopback("0.0.0.0") and not is_loopback("prefill.example")
    check_exposure("127.0.0.1", None, insecure=False)  # an endpoint built with secret=None, in process
    check_exposure(NOT_LOOPBACK, b"secret", insecure=False)  # signed: only secret holders are answered
    with pytest.raises(ConfigError, match="--insecure-side-channel"):
        check_exposure(NOT_LOOPBACK, None, insecure=False)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        check_exposure(NOT_LOOPBACK, None, insecure=True)
    assert "no secret" in caplog.text and "write into it" in caplog.text


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
