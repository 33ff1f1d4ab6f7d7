from __future__ import annotations

import importlib.util
import os

import pytest

from kvbridge.transfer import nixl_build

# One torch thread per process: tests start several engine processes on a 2-core machine, and
# oversubscribed intra-op threads slow small matmuls down by orders of magnitude. Child processes
# inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests talk to loopback only. UCX is kept on loopback by kvbridge itself (a side channel on
# 127.0.0.1 restricts UCX to `lo`), so UCX_NET_DEVICES is left unset: tests/serve/test_netns.py
# checks that the same rule picks a real interface.


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    has_nixl = nixl_build.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "nixl" in item.keywords and not has_nixl:
            item.add_marker(pytest.mark.skip(reason="needs NIXL: pip install nixl-cu12"))
