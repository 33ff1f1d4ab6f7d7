"""A frozen decode node (SIGSTOP) behind the proxy, beside a live one: real processes on loopback.

The proxy ejects a node whose health checks go unanswered only after `--silent-checks` of them in a
row (a busy CPU node can leave /health waiting). Until then the node is suspect: the proxy must
route around it while the other decode node answers, or every request sent to the frozen node
waits out `--timeout` before failing over. Here `--silent-checks` is large, so the frozen node is
never ejected during the test: only the suspect rule keeps requests off it.
"""

from __future__ import annotations

import importlib.util
import signal
import tempfile
import time

import pytest

from kvbridge.serve.launcher import http_json, start_node, start_proxy, wait_healthy, wait_proxy_routes_to_all

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("kvbridge.connectors.nixl.connector") is None, reason="needs the NixlConnector"
    ),
]

NODE_ARGS = ["--num-threads", "1", "--num-blocks", "64", "--max-model-len", "256"]
PROXY_TIMEOUT_S = 120.0  # what a request routed to the frozen node would wait before failing over
SUSPECT_WITHIN_S = 30.0  # one health check interval (0.5 s) plus its 5 s timeout, with room for a loaded machine


def test_requests_go_around_a_frozen_decode_node_before_it_is_ejected():
    with tempfile.TemporaryDirectory() as log_dir:
        prefill = start_node("prefill", "prefill", log_dir, extra_args=NODE_ARGS)
        frozen = start_node("decode-frozen", "decode", log_dir, extra_args=NODE_ARGS)
        alive = start_node("decode-alive", "decode", log_dir, extra_args=NODE_ARGS)
        procs = [prefill, frozen, alive]
        proxy = start_proxy([prefill.url], [frozen.url, alive.url], log_dir, PROXY_TIMEOUT_S,
                            ["--health-interval", "0.5", "--silent-checks", "1000"])  # fmt: skip
        procs.append(proxy)
        try:
            wait_healthy(procs, timeout_s=120)
            wait_proxy_routes_to_all(proxy, 60)
            frozen.popen.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + SUSPECT_WITHIN_S
            while not (health := http_json(f"{proxy.url}/health")[1])["decode"][frozen.url].startswith("suspect"):
                assert time.monotonic() < deadline, f"the frozen node is still {health['decode'][frozen.url]!r}"
                time.sleep(0.2)

            for i in range(3):
                body = {"prompt": f"Request {i} goes around the frozen node.", "max_tokens": 4, "temperature": 0}
                status, answer = http_json(f"{proxy.url}/v1/completions", body, timeout_s=PROXY_TIMEOUT_S + 60)
                assert status == 200, answer
                report = answer["kvbridge"]["proxy"]
                # One attempt, on the live node: a request sent to the frozen one first would have
                # waited PROXY_TIMEOUT_S and come back with decode_attempts 2.
                assert report["decode_url"] == alive.url and report["decode_attempts"] == 1, report
                assert report["disaggregated"], answer["kvbridge"]
            status, health = http_json(f"{proxy.url}/health")
            assert status == 200 and health["decode"][frozen.url].startswith("suspect"), health  # never ejected
            assert health["decode"][alive.url] == "ok", health
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
            for proc in procs:
                proc.stop()
