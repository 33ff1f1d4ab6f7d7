"""P/D failure semantics as an HTTP client sees them: the prefill node dies after the prefill leg.

A decode node with the `recompute` policy still answers 200 with the colocated completion; one
with the `fail` policy answers 500 with the reason, and 200 with the colocated completion to the next
request naming the dead node (refused before admission, so no load error reaches the policy). Neither
hangs, and neither leaks a block.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time

import pytest

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import http_json, start_node, wait_healthy
from kvbridge.serve.proxy_report import load_failure_cause

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

PROMPT = "The prefill node will be gone by the time the decode node asks. " * 3
MAX_TOKENS = 5
FAST_FAIL = '{"handshake_timeout_s": 1.0, "handshake_retries": 0, "transfer_timeout_s": 5.0}'
NODE_ARGS = ["--num-threads", "1", "--num-blocks", "128", "--max-model-len", "512"]


def test_prefill_killed_between_legs_recompute_succeeds_and_fail_policy_errors():
    with tempfile.TemporaryDirectory() as log_dir:
        procs = []
        try:
            prefill = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS)
            decode_args = [*NODE_ARGS, "--kv-connector-extra", FAST_FAIL, "--load-failure-policy"]
            recompute = start_node("decode-recompute", "decode", log_dir, extra_args=[*decode_args, "recompute"])
            fail = start_node("decode-fail", "decode", log_dir, extra_args=[*decode_args, "fail"])
            procs = [prefill, recompute, fail]
            with LLM(max_model_len=512) as llm:  # the reference, while the nodes boot
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = llm.generate(PROMPT, params)[0].outputs[0].token_ids
            wait_healthy(procs, timeout_s=120)

            body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
            status, first = http_json(f"{prefill.url}/v1/completions", body)
            assert status == 200 and first["kv_transfer_params"]["remote_block_ids"], first
            # A lease token the prefill node never handed out: it reads, but the prefill does not vouch for it.
            forged = {**first["kv_transfer_params"], "remote_lease_token": "f" * 64, "do_remote_prefill": True}
            forged_status, forged_answer = http_json(
                f"{recompute.url}/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "kv_transfer_params": forged}, timeout_s=60,
            )  # fmt: skip
            assert http_json(f"{recompute.url}/v1/kvbridge/reset_prefix_cache", {})[0] == 200  # it computed the prompt
            prefill.popen.kill()  # dies holding the blocks the decode nodes were told to read
            prefill.popen.wait(10)

            decode_body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
            decode_body["kv_transfer_params"] = {**first["kv_transfer_params"], "do_remote_prefill": True}
            t0 = time.monotonic()
            ok_status, ok = http_json(f"{recompute.url}/v1/completions", decode_body, timeout_s=60)
            recompute_s = time.monotonic() - t0
            t0 = time.monotonic()
            err_status, err = http_json(f"{fail.url}/v1/completions", decode_body, timeout_s=60)
            fail_s = time.monotonic() - t0
            # The same params again: the side channel that did not answer is not tried again for a while
            # (unreachable_peer_cooldown_s), so the prompt is computed there from the start, no load error.
            again_status, again = http_json(f"{fail.url}/v1/completions", decode_body, timeout_s=60)
            states = [http_json(f"{p.url}/v1/kvbridge/state")[1] for p in (recompute, fail)]
        finally:
            for proc in procs:
                proc.stop()

    print(f"recompute: {recompute_s:.2f}s; fail policy: {fail_s:.2f}s, {err}")
    assert ok_status == 200, ok
    assert ok["choices"][0]["token_ids"] == expected  # recomputed locally, same tokens
    assert ok["kvbridge"]["num_external_tokens"] == 0
    # Each answer says why it was recomputed, in the decode node's words, which the proxy classifies.
    print(ok["kvbridge"]["kv_load_error"], "|", forged_answer["kvbridge"]["kv_load_error"])
    assert ok["kvbridge"]["num_failed_load_blocks"] > 0, ok["kvbridge"]
    assert load_failure_cause(ok["kvbridge"]["kv_load_error"]) in ("peer_unreachable", "timeout"), ok["kvbridge"]
    assert forged_status == 200 and forged_answer["choices"][0]["token_ids"] == expected, forged_answer
    assert load_failure_cause(forged_answer["kvbridge"]["kv_load_error"]) == "proof_failed", forged_answer["kvbridge"]
    assert err_status == 500 and err["error"]["type"] == "engine_error", err
    assert "--load-failure-policy recompute" in err["error"]["message"], err  # the flag the operator types
    assert "KVTransferConfig" not in err["error"]["message"], err
    assert recompute_s < 30 and fail_s < 30, (recompute_s, fail_s)  # bounded by the connector's deadlines
    assert again_status == 200 and again["choices"][0]["token_ids"] == expected, again
    assert again["kvbridge"]["num_external_tokens"] == again["kvbridge"]["num_failed_load_blocks"] == 0, again
    assert load_failure_cause(again["kvbridge"]["kv_load_error"]) == "peer_unreachable", again["kvbridge"]
    for state in states:
        assert state["integrity"]["ok"], state
        assert state["stats"]["num_used_blocks"] == 0, state["stats"]
