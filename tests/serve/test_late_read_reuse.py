"""No reuse under doubt, from outside: a read whose bytes land past every timeout never lands in blocks
that another request owns.

The decode node runs with the fault hook KVBRIDGE_FAULT_DELAY_READ_S (transfer/delayed_post.py): each
NIXL read stays in flight for DELAY_S and its bytes land again then, as a stalled prefill's would, far
past the read's deadline (`transfer_timeout_s`, 1 s) and past as long again. The client of
that request hangs up meanwhile (the request is aborted), and another client's prompt needs its blocks
(the cache is too small for both). That prompt must give the colocated engine's tokens, and the same
prompt again once the late bytes have landed (now a prefix-cache hit on the blocks it computed) the
same tokens with the same logprobs.
Had a timeout handed the quarantined blocks back, the late bytes (another prompt's KV) would land in
the blocks the next request computed and cached: its repeat would be conditioned on the wrong KV.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
import json

import pytest

from kvbridge import LLM, SamplingParams
from kvbridge.serve.launcher import http_json, start_node, wait_healthy

pytestmark = pytest.mark.nixl

DELAY_S = 5.0
NUM_BLOCKS = 16  # 16-token blocks: a 200-token prompt holds 13, so two of them never fit together
MAX_TOKENS = 4
NODE_ARGS = ["--num-threads", "1", "--max-model-len", "256", "--flush-timeout", "1"]
DECODE_EXTRA = '{"transfer_timeout_s": 1.0, "handshake_timeout_s": 5.0, "handshake_retries": 0}'
LATE, NEXT = "A read whose bytes come late. " * 7, "The next owner of these blocks. " * 7  # 203 and 224 tokens


def _completion(url: str, prompt: str, params: dict | None = None, timeout_s: float = 60.0) -> tuple[int, dict]:
    body = {"prompt": prompt[:200], "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    if params is not None:
        body["kv_transfer_params"] = params
    return http_json(f"{url}/v1/completions", body, timeout_s=timeout_s)


def _hang_up_after(url: str, prompt: str, params: dict, after_s: float) -> None:
    """A client that sends the request and goes away before the answer (the node aborts the request)."""
    body = json.dumps({"prompt": prompt[:200], "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params})
    req = urllib.request.Request(f"{url}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=after_s).read()
    except (TimeoutError, socket.timeout, urllib.error.URLError):
        return
    pytest.fail("the delayed read's request was answered before its read could have landed")


def test_blocks_a_late_read_may_still_write_are_never_given_to_another_request():
    with tempfile.TemporaryDirectory() as log_dir, tempfile.TemporaryDirectory() as runtime:
        os.chmod(runtime, 0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")} | {"XDG_RUNTIME_DIR": runtime}
        prefill = start_node("prefill", "prefill", log_dir, extra_args=[*NODE_ARGS, "--num-blocks", "64"], env=env)
        decode = start_node("decode", "decode", log_dir, env=env | {"KVBRIDGE_FAULT_DELAY_READ_S": str(DELAY_S)},
                            extra_args=[*NODE_ARGS, "--num-blocks", str(NUM_BLOCKS), "--kv-connector-extra", DECODE_EXTRA])  # fmt: skip
        try:
            with LLM(max_model_len=256) as llm:  # the reference, while the nodes boot
                greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                expected = llm.generate(NEXT[:200], greedy)[0].outputs[0].token_ids
            wait_healthy([prefill, decode], 120)
            status, first = _completion(prefill.url, LATE, {"do_remote_decode": True})
            assert status == 200 and first["kv_transfer_params"]["remote_block_ids"], first
            params = {**first["kv_transfer_params"], "do_remote_prefill": True}

            start = time.monotonic()
            _hang_up_after(decode.url, LATE, params, after_s=2.0)  # its read expired at 1 s, in quarantine
            status, body = _completion(decode.url, NEXT)  # needs the quarantined blocks
            print(f"the next request answered {time.monotonic() - start:.1f} s after the late read started")
            assert status == 200 and body["choices"][0]["token_ids"] == expected, body

            time.sleep(max(0.0, start + DELAY_S + 1.0 - time.monotonic()))  # the late bytes have landed
            status, again = _completion(decode.url, NEXT)  # a prefix-cache hit on the blocks it computed
            assert status == 200 and again["kvbridge"]["num_cached_tokens"] > 0, again
            assert again["choices"][0]["token_ids"] == expected, "a late write landed in blocks another request owned"
            # the tiny model's tokens barely depend on its KV: its logprobs do
            first_lp, again_lp = (b["choices"][0]["logprobs"]["token_logprobs"] for b in (body, again))
            assert again_lp == pytest.approx(first_lp, abs=1e-3), "a late write landed in blocks another request owned"
            worker = http_json(f"{decode.url}/v1/kvbridge/state")[1]["stats"]["connector"]["worker"]
            assert worker["num_quarantined_reads_total"] == 1, worker
        finally:
            for proc in (prefill, decode):
                proc.stop()
