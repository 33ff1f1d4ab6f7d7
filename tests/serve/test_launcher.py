"""Launcher helpers: ports, health waits with deadlines and log tails, stopping children."""

from __future__ import annotations

import random
import sys
import tempfile
import time

import pytest

from kvbridge.errors import NodeStartError
from kvbridge.serve.launcher import ManagedProcess, free_ports, wait_healthy


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_free_ports_are_never_ones_an_outgoing_connection_could_take():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    if first_ephemeral < 12_000:
        pytest.skip(f"the ephemeral range starts at {first_ephemeral}: no room below it")
    assert all(p < first_ephemeral for p in free_ports(16))


def test_free_ports_do_not_follow_the_seed_of_random():
    # Two test processes that both seed `random` must not be handed the same ports.
    random.seed(1234)
    first = free_ports(4)
    random.seed(1234)
    assert free_ports(4) != first


def _proc(code: str, log_dir: str, name: str = "child") -> ManagedProcess:
    return ManagedProcess(name, f"http://127.0.0.1:{free_ports(1)[0]}", [sys.executable, "-c", code], log_dir)


def test_a_child_that_exits_is_reported_with_its_log():
    with tempfile.TemporaryDirectory() as log_dir:
        proc = _proc("import sys; print('boom: no such model', flush=True); sys.exit(3)", log_dir)
        try:
            with pytest.raises(NodeStartError, match="(?s)exited with code 3.*boom: no such model"):
                wait_healthy([proc], timeout_s=30)
        finally:
            proc.stop()


def test_a_child_that_never_gets_healthy_hits_the_deadline_and_stop_kills_it():
    with tempfile.TemporaryDirectory() as log_dir:
        # Ignores SIGTERM: stop() must fall back to SIGKILL after the grace period.
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
        proc = _proc(code, log_dir, "stubborn")
        try:
            t0 = time.monotonic()
            with pytest.raises(NodeStartError, match="stubborn not healthy after 1s"):
                wait_healthy([proc], timeout_s=1.0)
            assert time.monotonic() - t0 < 10
        finally:
            code = proc.stop(grace_s=0.5)
        assert code == -9 and not proc.is_running()
