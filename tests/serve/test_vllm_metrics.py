"""The metrics routers read (serve/vllm_metrics.py), scraped from a real `kvbridge serve` node as a router
scrapes it: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and
`vllm:cache_config_info` with vLLM's names, labels and meanings, beside kvbridge's own series."""

from __future__ import annotations

import tempfile
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvbridge.serve.launcher import http_json, start_node, wait_healthy

NUM_BLOCKS = 32
LABELS = (("engine", "0"), ("model_name", "tiny"))


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_node_reports_running_waiting_usage_and_cache_config_as_vllm_does():
    with tempfile.TemporaryDirectory() as log_dir:
        args = ["--no-connector", "--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "256",
                "--max-num-seqs", "1"]  # fmt: skip  # one request runs at a time: a second one waits
        node = start_node("metrics", "both", log_dir, extra_args=args)
        try:
            wait_healthy([node], timeout_s=120)
            idle = _scrape(node.url)
            assert idle[("vllm:num_requests_running", LABELS)] == 0
            assert idle[("vllm:num_requests_waiting", LABELS)] == 0
            assert idle[("vllm:kv_cache_usage_perc", LABELS)] == 0
            info = [labels for (name, labels), value in idle.items() if name == "vllm:cache_config_info" and value == 1]
            assert len(info) == 1, idle
            assert {("block_size", "16"), ("num_gpu_blocks", str(NUM_BLOCKS)), ("enable_prefix_caching", "True"),
                    ("engine", "0")} <= set(info[0])  # fmt: skip

            # Two long requests at once: one runs, the other waits, both hold or wait for KV blocks.
            body = {"prompt": list(range(1, 101)), "max_tokens": 120, "ignore_eos": True, "temperature": 0}
            answers: list[int] = []
            threads = [threading.Thread(target=lambda: answers.append(http_json(f"{node.url}/v1/completions", body,
                                                                                 timeout_s=120)[0])) for _ in range(2)]  # fmt: skip
            for thread in threads:
                thread.start()
            seen: set[tuple[float, float]] = set()
            usages: list[float] = []
            while any(t.is_alive() for t in threads):
                busy = _scrape(node.url)
                seen.add((busy[("vllm:num_requests_running", LABELS)], busy[("vllm:num_requests_waiting", LABELS)]))
                usages.append(busy[("vllm:kv_cache_usage_perc", LABELS)])
                time.sleep(0.02)
            for thread in threads:
                thread.join()
            assert answers == [200, 200]
            assert (1, 1) in seen, f"never saw one request running and one waiting: {sorted(seen)}"
            assert all(running <= 1 for running, _ in seen)
            # 100 prompt tokens + up to 120 generated, blocks of 16: 7 to 14 of the 32 blocks per request.
            assert max(usages) >= 7 / NUM_BLOCKS and all(0 <= u <= 1 for u in usages), usages

            done = _scrape(node.url)
            assert done[("vllm:num_requests_running", LABELS)] == 0
            assert done[("vllm:num_requests_waiting", LABELS)] == 0
            # As in vLLM, cached blocks nobody holds are free (evictable): usage is back to 0 while they stay cached.
            assert done[("vllm:kv_cache_usage_perc", LABELS)] == 0
            assert done[("kvbridge_engine_num_cached_blocks", ())] > 0
            assert done[("kvbridge_requests_total", (("outcome", "ok"),))] == 2  # kvbridge's own series are kept
        finally:
            node.stop()
