"""vLLM's own router (`vllm-router`, kvbridge's dev extra; on PATH) in P/D mode in front of unmodified vLLM
api_servers that move KV through KVBridgeConnector + kvbridge's NixlConnector: the router a vLLM fleet runs,
with kvbridge inside vLLM. A completion through the router gives the colocated greedy tokens, and the decode
server read the prompt's full blocks over NIXL (its kvbridge metrics count the transfer and its bytes)."""

from __future__ import annotations

import shutil

import pytest
from adapter_e2e import (
    BYTES,
    FAILURES,
    LOAD_ERRORS,
    TRANSFERS,
    delta,
    greedy,
    kvbridge_metrics,
    kvbridge_transfer_config,
    random_prompt,
    wait_for_metrics,
)
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import complete
from vllm_server import CPU_BLOCK_SIZE

from kvbridge.serve.launcher import HOST, ManagedProcess, free_ports, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
PROMPT_LEN = 300  # two full blocks of vLLM's CPU block size and a partial one
NIXL_OPTIONS = dict(lease_s=60.0, handshake_timeout_s=3.0, handshake_retries=1, transfer_timeout_s=30.0)


@pytest.fixture(scope="module")
def routed(vllm_servers, tiny_checkpoint, tmp_path_factory):
    exe = shutil.which("vllm-router")
    if exe is None:
        pytest.fail("vllm-router is not on PATH: pip install -e '.[dev]' in the system python (it is in the dev extra)")

    def start(name: str, role: str):
        config = kvbridge_transfer_config(role, "NixlConnector", **NIXL_OPTIONS)
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config)

    prefill, decode = start("prefill", "kv_producer"), start("decode", "kv_consumer")
    vllm_servers.wait()
    (port,) = free_ports(1)
    argv = [exe, "--host", HOST, "--port", str(port), "--vllm-pd-disaggregation", "--prefill", prefill.url,
            "--decode", decode.url, "--policy", "round_robin", "--log-level", "info"]  # fmt: skip
    router = ManagedProcess("vllm-router", f"http://{HOST}:{port}", argv, str(tmp_path_factory.mktemp("vllm-router")))
    try:
        wait_healthy([router], 120)
        yield prefill, decode, router
    finally:
        router.stop()


def test_a_completion_through_vllm_router_is_colocated_and_the_decode_read_the_kv(routed, tiny_checkpoint):
    prefill, decode, router = routed
    # The first P/D request handshakes; a loaded machine may recompute it instead: warm up, then measure.
    complete(router.url, {**greedy(random_prompt(11, 200), 1), "model": tiny_checkpoint})
    body = {**greedy(random_prompt(12, PROMPT_LEN), 8), "model": tiny_checkpoint}
    colocated = complete(prefill.url, body).token_ids
    before = kvbridge_metrics(decode.url)
    routed_tokens = complete(router.url, body).token_ids
    after = wait_for_metrics(decode.url, lambda m: delta(m, before, TRANSFERS) >= 1)
    assert routed_tokens == colocated
    assert delta(after, before, TRANSFERS) == 1, f"the decode read no KV over NIXL: {after}"
    num_blocks = PROMPT_LEN // CPU_BLOCK_SIZE
    assert delta(after, before, BYTES) == num_blocks * CPU_BLOCK_SIZE * kv_bytes_per_token(tiny_checkpoint)
    assert delta(after, before, FAILURES) == 0 and delta(after, before, LOAD_ERRORS) == 0, after
