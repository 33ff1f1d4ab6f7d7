"""P/D between kvbridge's reference engine and an unmodified vLLM (CPU, float32) on one checkpoint, both ways.

One vLLM api_server (KVBridgeConnector + kvbridge's NixlConnector, kv_both) and one `kvbridge serve`
node (role both) serve the same tiny checkpoint; either prefills for the other over NIXL. Their KV
differs in every way the translator knows: 16-token blocks of block-major "2NHD" pages on kvbridge's
side; 128-token blocks of layer-major "H2ND-KT" pages on vLLM's (vLLM's CPU VEC kernels keep each
head's K column-major, [head_dim, block_size]). What has to agree is the checkpoint's identity (the
adapter names it as the engine does, from its files), the prompt's block hashes at the prefill's
block size, and the model hash of the layouts.

Per direction: the decode engine's own colocated answer (then its prefix cache is reset, so the
decode leg must read), the two-leg protocol of vLLM's toy proxy, and then
* the decode's greedy tokens equal its own colocated tokens and the prefill engine's;
* the decode read the prompt's tokens over NIXL through one staged plan (external tokens > 0, the
  bytes of exactly those tokens, no failure, load error or digest mismatch);
* nothing is stranded: the prefill's lease ends and its blocks are freed, the decode holds no block.
Before the page format followed vLLM's kernels, both directions moved every byte and passed every
digest, and the tokens were wrong: K was read as if it were [block_size, head_dim].
"""

from __future__ import annotations

import json
import time

import pytest
from adapter_e2e import (
    BYTES,
    FAILURES,
    HELD,
    LEASES,
    LOAD_ERRORS,
    TRACKED,
    TRANSFERS,
    delta,
    greedy,
    kvbridge_metrics,
    kvbridge_transfer_config,
    random_prompt,
    wait_for_metrics,
)
from vllm_checkpoint import kv_bytes_per_token
from vllm_client import complete, pd_complete, scrape_metrics
from vllm_server import CPU_BLOCK_SIZE

from kvbridge.serve.launcher import http_json, start_node, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
MAX_TOKENS = 8
PROMPT_LEN = 300
REF_BLOCK_SIZE = 16  # `kvbridge serve`'s default
# Generous deadlines (not what these tests measure): CI's 2-core machines have seen a server go silent
# for 16 s at the first read from it (stall_watch.py logs such silences).
NIXL_OPTIONS = dict(lease_s=90.0, handshake_timeout_s=20.0, handshake_retries=2, transfer_timeout_s=60.0)
REF_OPTIONS = json.dumps({k: NIXL_OPTIONS[k] for k in ("lease_s", "handshake_timeout_s", "transfer_timeout_s")})
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
NODE_START_TIMEOUT_S = 300.0


class Engines:
    def __init__(self, vllm, ref, kv_bytes_per_token: int) -> None:
        self.vllm, self.ref, self.kv_bytes_per_token = vllm, ref, kv_bytes_per_token


@pytest.fixture(scope="module")
def engines(vllm_servers, tiny_checkpoint, tmp_path_factory):
    config = kvbridge_transfer_config("kv_both", "NixlConnector", **NIXL_OPTIONS)
    vllm = vllm_servers.start("vllm", tiny_checkpoint, max_model_len=MAX_MODEL_LEN, kv_transfer_config=config,
                              env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip  # for POST /reset_prefix_cache
    ref = start_node(
        "kvbridge", "both", str(tmp_path_factory.mktemp("kvbridge-node")), model=tiny_checkpoint,
        extra_args=["--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1",
                    "--kv-connector-extra", REF_OPTIONS],
    )  # fmt: skip
    try:
        vllm_servers.wait()
        wait_healthy([ref], NODE_START_TIMEOUT_S)
        yield Engines(vllm, ref, kv_bytes_per_token(tiny_checkpoint))
    finally:
        ref.stop()
        print(f"kvbridge node log: {ref.log_path}")


def _ref_state(engines: Engines) -> dict:
    status, state = http_json(f"{engines.ref.url}/v1/kvbridge/state")
    assert status == 200, state
    assert state["integrity"]["ok"], state["integrity"]
    return state


def _ref_worker(stats: dict) -> dict:
    return stats["connector"]["worker"]


def _reset(url: str, path: str) -> None:
    status, body = http_json(f"{url}{path}", {})
    assert status == 200, f"POST {path}: {status} {body}"


def _wait_ref(engines: Engines, is_done, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = _ref_state(engines)
        if is_done(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def test_reference_engine_prefill_feeds_a_vllm_decode(engines):
    prompt = random_prompt(seed=101, num_tokens=PROMPT_LEN)
    body = greedy(prompt, MAX_TOKENS)
    prefill_colocated = complete(engines.ref.url, body).token_ids
    decode_colocated = complete(engines.vllm.url, body).token_ids
    _reset(engines.vllm.url, "/reset_prefix_cache")  # the decode leg must read the prompt's KV
    before, hits_before = kvbridge_metrics(engines.vllm.url), scrape_metrics(engines.vllm.url).get(EXTERNAL_HITS, 0.0)

    out = pd_complete(engines.ref.url, engines.vllm.url, body)
    after = wait_for_metrics(engines.vllm.url, lambda m: delta(m, before, TRANSFERS) >= 1)
    external = scrape_metrics(engines.vllm.url).get(EXTERNAL_HITS, 0.0) - hits_before

    # the prefill's 16-token blocks hold 288 of the 300 tokens; the decode's 128-token blocks take 256
    num_tokens = len(out.kv_transfer_params["remote_block_ids"]) * REF_BLOCK_SIZE // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE
    print(f"ref -> vLLM: {out.token_ids}, read {delta(after, before, BYTES)} B, {external:.0f} external tokens")
    assert out.token_ids == decode_colocated, "vLLM decoded other tokens from the KV it read than from its own"
    assert decode_colocated == prefill_colocated, "the two engines' colocated tokens differ (their numerics)"
    assert external == num_tokens > 0
    assert delta(after, before, TRANSFERS) == 1 and delta(after, before, BYTES) == num_tokens * engines.kv_bytes_per_token
    assert delta(after, before, "kvbridge_worker_num_staged_plan_reads") == 1
    for name in (FAILURES, LOAD_ERRORS, "kvbridge_worker_num_digest_mismatches", "kvbridge_worker_num_unverified_reads"):
        assert delta(after, before, name) == 0, (name, after)
    # nothing stranded: the prefill's lease ended and freed its blocks; vLLM tracks no request
    state = _wait_ref(engines, lambda s: _ref_worker(s["stats"])["num_leases"] == 0 and s["stats"]["num_used_blocks"] == 0)
    assert _ref_worker(state["stats"])["num_leases"] == 0 and state["stats"]["num_used_blocks"] == 0, state
    metrics = wait_for_metrics(engines.vllm.url, lambda m: m.get(TRACKED) == 0 and m.get(HELD) == 0)
    assert metrics.get(TRACKED) == 0 and metrics.get(HELD) == 0, metrics


def test_vllm_prefill_feeds_a_reference_engine_decode(engines):
    prompt = random_prompt(seed=202, num_tokens=PROMPT_LEN)
    body = greedy(prompt, MAX_TOKENS)
    prefill_colocated = complete(engines.vllm.url, body).token_ids
    decode_colocated = complete(engines.ref.url, body).token_ids
    _reset(engines.ref.url, "/v1/kvbridge/reset_prefix_cache")  # the decode leg must read the prompt's KV
    before = _ref_state(engines)["stats"]

    out = pd_complete(engines.vllm.url, engines.ref.url, body)
    after = _wait_ref(engines, lambda s: _ref_worker(s["stats"])["num_transfers"] > _ref_worker(before)["num_transfers"])["stats"]

    def moved(name: str) -> int:
        return _ref_worker(after)[name] - _ref_worker(before)[name]

    # the prefill's 128-token blocks hold 256 of the 300 tokens: all of them fit 16-token blocks
    num_tokens = len(out.kv_transfer_params["remote_block_ids"]) * CPU_BLOCK_SIZE
    external = after["num_external_tokens"] - before["num_external_tokens"]
    print(f"vLLM -> ref: {out.token_ids}, read {moved('bytes_transferred')} B, {external} external tokens")
    assert out.token_ids == decode_colocated, "kvbridge decoded other tokens from the KV it read than from its own"
    assert decode_colocated == prefill_colocated, "the two engines' colocated tokens differ (their numerics)"
    assert external == num_tokens > 0
    assert moved("num_transfers") == 1 and moved("bytes_transferred") == num_tokens * engines.kv_bytes_per_token
    assert moved("num_staged_plan_reads") == 1
    for name in ("num_failures", "num_load_errors", "num_digest_mismatches", "num_unverified_reads"):
        assert moved(name) == 0, (name, after)
    # nothing stranded: vLLM's lease ended and it holds no block for the send; the decode holds none
    metrics = wait_for_metrics(engines.vllm.url, lambda m: m.get(LEASES) == 0 and m.get(HELD) == 0)
    assert metrics.get(LEASES) == 0 and metrics.get(HELD) == 0, metrics
    state = _wait_ref(engines, lambda s: s["stats"]["num_used_blocks"] == 0 and not s["has_pending_transfers"])
    assert state["stats"]["num_used_blocks"] == 0 and not state["has_pending_transfers"], state
