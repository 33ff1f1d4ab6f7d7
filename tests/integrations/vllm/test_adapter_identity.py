"""Which requests share KV through KVBridgeConnector, seen from outside real vLLM servers (CPU, 0.32).

vLLM's prefix cache keys a block by its tokens and its extra keys (cache salt, LoRA, multimodal
inputs, prompt embeddings); kvbridge's block hashes must cover the same, or two tenants with the
same prompt share KV through kvbridge that vLLM itself keeps apart. Servers of one tiny checkpoint:
* `offload` (OffloadingConnector, kv_both): a prompt stored under cache_salt "tenant-a" is never
  loaded from the host tier for "tenant-b" after vLLM's prefix cache is reset, and is for "tenant-a";
* `prefill` / `decode` (NixlConnector, kv_producer / kv_consumer with vLLM's "recompute" policy):
  a decode request whose cache_salt differs from its prefill's does not read the prefill's KV (the
  block hash in the params does not match: computed locally, colocated tokens); the same salt does.
"""

from __future__ import annotations

import time

import pytest
from adapter_e2e import (
    MISMATCHED,
    TRANSFERS,
    delta,
    greedy,
    kvbridge_metrics,
    kvbridge_transfer_config,
    random_prompt,
    reset_prefix_cache,
    wait_for_metrics,
)
from vllm_client import PREFILL_LEG_PARAMS, complete, warm_up_pd
from vllm_server import CPU_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
NUM_FULL_BLOCKS = 3
PROMPT_LEN = NUM_FULL_BLOCKS * CPU_BLOCK_SIZE + 17
LOADED, STORED = "kvbridge_worker_blocks_loaded", "kvbridge_worker_blocks_stored"


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint):
    def start(name, role, connector, **kwargs):
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN,
                                  kv_transfer_config=kvbridge_transfer_config(role, connector, **kwargs),
                                  env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip

    start_s = time.monotonic()
    offload = start("offload", "kv_both", "OffloadingConnector", host_num_blocks=64)
    prefill = start("prefill", "kv_producer", "NixlConnector", lease_s=60)
    decode = start("decode", "kv_consumer", "NixlConnector")
    vllm_servers.wait()
    warm_up_pd(prefill.url, decode.url, greedy(random_prompt(seed=1, num_tokens=200), 1))  # the NIXL handshake
    print(f"\nservers ready and warmed up after {time.monotonic() - start_s:.0f} s")
    return offload, prefill, decode


def _salted(prompt: list[int], salt: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return greedy(prompt, max_tokens, cache_salt=salt, **extra)


def test_host_tier_never_serves_another_salts_prompt(servers):
    offload, _, _ = servers
    prompt = random_prompt(seed=300, num_tokens=PROMPT_LEN)
    first = complete(offload.url, _salted(prompt, "tenant-a"))
    wait_for_metrics(offload.url, lambda m: m.get(STORED, 0) >= NUM_FULL_BLOCKS)
    reset_prefix_cache(offload.url)

    before = kvbridge_metrics(offload.url)
    other = complete(offload.url, _salted(prompt, "tenant-b"))
    after = wait_for_metrics(offload.url, lambda m: delta(m, before, STORED) >= NUM_FULL_BLOCKS)  # b's own blocks
    assert delta(after, before, LOADED) == 0, f"tenant-b was served tenant-a's KV from the host tier: {after}"
    assert delta(after, before, STORED) == NUM_FULL_BLOCKS, after  # stored under b's own hashes
    assert other.token_ids == first.token_ids  # the salt changes nothing but who may share

    reset_prefix_cache(offload.url)
    before = kvbridge_metrics(offload.url)
    again = complete(offload.url, _salted(prompt, "tenant-a"))
    after = wait_for_metrics(offload.url, lambda m: delta(m, before, LOADED) > 0)
    assert delta(after, before, LOADED) == NUM_FULL_BLOCKS, f"tenant-a's prompt was not served from the host tier: {after}"
    assert again.token_ids == first.token_ids


def _prefill_leg(url: str, prompt: list[int], salt: str) -> dict:
    body = _salted(prompt, salt, max_tokens=1, kv_transfer_params=dict(PREFILL_LEG_PARAMS))
    params = complete(url, body).kv_transfer_params
    assert params, "the prefill server returned no kv_transfer_params"
    return params


def test_pd_decode_with_another_salt_computes_locally(servers):
    _, prefill, decode = servers
    prompt = random_prompt(seed=310, num_tokens=PROMPT_LEN)
    expected = complete(prefill.url, _salted(prompt, "tenant-b"))  # colocated, on the prefill server
    params = _prefill_leg(prefill.url, prompt, "tenant-a")
    before = kvbridge_metrics(decode.url)

    out = complete(decode.url, _salted(prompt, "tenant-b", kv_transfer_params=params))
    after = wait_for_metrics(decode.url, lambda m: delta(m, before, MISMATCHED) > 0)

    assert delta(after, before, TRANSFERS) == 0, f"the decode read another tenant's KV: {after}"
    assert delta(after, before, MISMATCHED) == 1, after
    assert out.token_ids == expected.token_ids


def test_pd_decode_with_the_same_salt_reads(servers):
    _, prefill, decode = servers
    prompt = random_prompt(seed=320, num_tokens=PROMPT_LEN)
    expected = complete(prefill.url, _salted(prompt, "tenant-a"))
    params = _prefill_leg(prefill.url, prompt, "tenant-a")
    before = kvbridge_metrics(decode.url)

    out = complete(decode.url, _salted(prompt, "tenant-a", kv_transfer_params=params))
    after = wait_for_metrics(decode.url, lambda m: delta(m, before, TRANSFERS) > 0)

    assert delta(after, before, TRANSFERS) == 1, after
    assert delta(after, before, MISMATCHED) == 0, after
    assert out.token_ids == expected.token_ids
