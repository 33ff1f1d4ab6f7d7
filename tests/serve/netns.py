"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for P/D tests over a
real interface (UCX over TCP, the side channel, partitions by taking the link down).

    with NetnsPair() as net:                        # raises NetnsUnavailable where it cannot
        net.exec_argv(net.prefill, ["kvbridge", ...])   # argv that runs inside a namespace
        with net.entered(net.decode):               # sockets this thread opens live there
            http_json(...)
        net.set_link(up=False)                      # a partition

Everything lives inside namespaces this object creates (private 10.213.0.0/24 addresses, nothing
routed out of them) and is deleted on exit. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from typing import NamedTuple

CLONE_NEWNET = 0x40000000
SUBNET_PREFIX = 24


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, no iproute2, no permission)."""


class Host(NamedTuple):
    namespace: str
    device: str  # its end of the veth pair
    address: str


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


class NetnsPair:
    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.prefill = Host(f"kvbp{tag}", f"kvbp{tag}"[:15], "10.213.0.1")
        self.decode = Host(f"kvbd{tag}", f"kvbd{tag}"[:15], "10.213.0.2")
        self._libc = ctypes.CDLL(None, use_errno=True)

    def __enter__(self) -> NetnsPair:
        if os.geteuid() != 0:
            raise NetnsUnavailable("creating network namespaces needs root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        try:
            for host in (self.prefill, self.decode):
                _ip("netns", "add", host.namespace)
            _ip("link", "add", self.prefill.device, "type", "veth", "peer", "name", self.decode.device)
            for host in (self.prefill, self.decode):
                _ip("link", "set", host.device, "netns", host.namespace)
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/{SUBNET_PREFIX}", "dev", host.device)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
                _ip("-n", host.namespace, "link", "set", host.device, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for host in (self.prefill, self.decode):
            for pid in subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)  # its veth end goes too

    def add_default_route(self, host: Host) -> None:
        """A default route out of `host`'s veth: what a wildcard-bound node guesses its address from."""
        _ip("-n", host.namespace, "route", "add", "default", "dev", host.device)

    def set_link(self, up: bool) -> None:
        """Take the link down (both ends: a partition) or bring it back."""
        for host in (self.prefill, self.decode):
            _ip("-n", host.namespace, "link", "set", host.device, "up" if up else "down")

    def rx_bytes(self, host: Host) -> int:
        """Bytes `host`'s veth end has received."""
        (link,) = json.loads(_ip("-n", host.namespace, "-j", "-s", "link", "show", "dev", host.device))
        return int(link["stats64"]["rx"]["bytes"])

    @staticmethod
    def exec_argv(host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.namespace, *argv]

    @contextlib.contextmanager
    def entered(self, host: Host) -> Iterator[None]:
        """Run this thread in `host`'s namespace (setns): sockets it opens meanwhile live there."""
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{host.namespace}", os.O_RDONLY)
        try:
            self._setns(target)
            try:
                yield
            finally:
                self._setns(own)
        finally:
            os.close(target)
            os.close(own)

    def _setns(self, fd: int) -> None:
        if self._libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")
