"""The offload connector's lifecycle scenarios inside GPU vLLM (0.25 on CUDA), as users meet them.

In-process (`inprocess_llm.py` with INPROCESS_LLM_DEVICE=cuda, a subprocess each, vLLM's engine in it):
* create -> generate -> shut down, NixlConnector and OffloadingConnector in turn: after the warm-up
  pair, `torch.cuda.memory_allocated()` and the device's used memory stay where they were, and no
  NIXL registration, NIXL agent or kvbridge thread outlives its engine;
* `reset_prefix_cache()` while an offload store is in flight waits for it and returns True, and the
  prompt then comes back from the host tier with the same tokens.

Servers (bf16, V1 model runner as test_gpu_adapter.py runs them, FLASH_ATTN):
* `multi`, a MultiConnector of NixlConnector and OffloadingConnector (kv_both) in a small KV cache,
  serves P/D as the decode of a kvbridge prefill and, for a prompt other prompts evicted, host-tier hits;
* `disk`, the OffloadingConnector with a disk tier under a host tier of one prompt's blocks, serves a
  prompt that two later prompts evicted from the host tier from disk, once vLLM's prefix cache is reset.
"""

from __future__ import annotations

import time

import pytest
from adapter_e2e import greedy, kvbridge_metrics, kvbridge_transfer_config, random_prompt, wait_for_metrics
from test_adapter_lifecycle import run_script
from test_adapter_offload import _loaded, _sum_of, check_disk_tier_serves_an_evicted_prompt
from vllm_client import complete, pd_complete

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
PROMPT_BLOCKS = 24
PROMPT_LEN = PROMPT_BLOCKS * BLOCK_SIZE + 9
MULTI_KV_BLOCKS = 72  # vLLM's whole KV cache on `multi`: one max_model_len, under three prompts
DISK_HOST_BLOCKS = PROMPT_BLOCKS + 1  # `disk`'s host tier: one prompt's blocks, not two
NUM_CYCLES = 6
MAX_ALLOCATED_GROWTH = 16 << 20  # torch's own allocations after the warm-up pair
MAX_USED_GROWTH = 256 << 20  # the device's used memory (the KV cache alone is gigabytes)
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def _gpu_script(monkeypatch, *args: str) -> list[dict]:
    monkeypatch.setenv("INPROCESS_LLM_DEVICE", "cuda")
    for name, value in V1_RUNNER.items():
        monkeypatch.setenv(name, value)
    return run_script(*args, timeout_s=600.0)


def test_create_generate_shutdown_cycles_return_gpu_memory(tiny_checkpoint, monkeypatch):
    before, *cycles = _gpu_script(monkeypatch, "cycles", tiny_checkpoint, str(NUM_CYCLES))
    warm, last = cycles[1], cycles[-1]
    for c in cycles:
        assert not [t for t in c["threads"] if t.startswith("kvbridge")], c
        assert c["nixl_agents_alive"] == 0 and c["nixl_deregistered"] == c["nixl_registered"], c
    assert len({tuple(c["tokens"]) for c in cycles}) == 1, "greedy tokens differ between cycles"
    print(f"torch.cuda.memory_allocated: {before['cuda_allocated'] >> 20} MiB before, {warm['cuda_allocated'] >> 20} "
          f"after 2 cycles, {last['cuda_allocated'] >> 20} after {NUM_CYCLES}; device used: {before['cuda_used'] >> 20}, "
          f"{warm['cuda_used'] >> 20}, {last['cuda_used'] >> 20} MiB")  # fmt: skip
    assert last["cuda_allocated"] - warm["cuda_allocated"] < MAX_ALLOCATED_GROWTH, (warm, last)
    assert last["cuda_used"] - warm["cuda_used"] < MAX_USED_GROWTH, (warm, last)


def test_reset_during_an_offload_store_waits_for_it(tiny_checkpoint, monkeypatch):
    (out,) = _gpu_script(monkeypatch, "offload-reset", tiny_checkpoint)
    assert out["reset_s"] >= out["store_delay_s"] / 2, out
    assert out["reset"] is True, "vLLM refused the reset: the adapter did not drain the store in flight"
    assert out["second_cached_tokens"] == out["num_prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE, out
    assert out["second"] == out["first"]


@pytest.fixture(scope="module")
def servers(vllm_servers, tiny_checkpoint, tmp_path_factory):
    gpu = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.08", "--attention-backend", "FLASH_ATTN",
           "--block-size", str(BLOCK_SIZE)]  # fmt: skip

    def start(name: str, config: dict | None, extra: list[str] = [], env: dict = {}):  # noqa: B006
        return vllm_servers.start(name, tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config,
                                  extra_args=[*gpu, *extra], env={**V1_RUNNER, **env})  # fmt: skip

    children = [{"connector": "NixlConnector"}, {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 512}}]
    disk_dir = tmp_path_factory.mktemp("kv-disk")
    started = time.monotonic()
    running = {
        "colocated": start("colocated", None),
        "prefill": start("prefill", kvbridge_transfer_config("kv_producer", "NixlConnector", lease_s=60)),
        "multi": start("multi", kvbridge_transfer_config("kv_both", "MultiConnector", connectors=children),
                       extra=["--num-gpu-blocks-override", str(MULTI_KV_BLOCKS)]),
        "disk": start("disk", kvbridge_transfer_config("kv_both", "OffloadingConnector", host_num_blocks=DISK_HOST_BLOCKS,
                                                       disk_dir=str(disk_dir)),
                      env={"VLLM_SERVER_DEV_MODE": "1"}),
    }  # fmt: skip
    vllm_servers.wait()
    print(f"\nGPU servers ready after {time.monotonic() - started:.0f} s")
    return running


def _transfers(metrics: dict[str, float]) -> float:
    return _sum_of(metrics, "worker", "num_transfers")  # the NixlConnector child's reads


def test_multiconnector_serves_pd_and_host_tier_hits(servers):
    prompt = random_prompt(seed=300, num_tokens=PROMPT_LEN)
    reference = complete(servers["colocated"].url, greedy(prompt, MAX_TOKENS))
    before = kvbridge_metrics(servers["multi"].url)

    pd = pd_complete(servers["prefill"].url, servers["multi"].url, greedy(prompt, MAX_TOKENS))
    pulled = wait_for_metrics(servers["multi"].url, lambda m: _transfers(m) > _transfers(before))
    assert pd.decode.token_ids == reference.token_ids
    assert _transfers(pulled) - _transfers(before) == 1, pulled

    for seed in range(301, 305):  # other prompts that need every block of the small cache: the first is evicted
        complete(servers["multi"].url, greedy(random_prompt(seed=seed, num_tokens=PROMPT_LEN), MAX_TOKENS))
    before = kvbridge_metrics(servers["multi"].url)
    again = complete(servers["multi"].url, greedy(prompt, MAX_TOKENS))
    after = wait_for_metrics(servers["multi"].url, lambda m: _loaded(m) > _loaded(before))
    assert again.token_ids == reference.token_ids
    assert _loaded(after) - _loaded(before) == PROMPT_BLOCKS, "the evicted prompt was not loaded from the host tier"
    assert _sum_of(after, "worker", "load_failures") == 0, after


def test_disk_tier_serves_a_prompt_the_host_tier_evicted(servers):
    check_disk_tier_serves_an_evicted_prompt(servers["disk"].url, PROMPT_LEN, PROMPT_BLOCKS, MAX_TOKENS)
