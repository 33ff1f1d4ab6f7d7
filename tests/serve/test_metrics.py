"""Prometheus rendering of the node metrics; the text must parse."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvbridge.serve.metrics import ServerMetrics, flatten_numeric


def test_flatten_numeric_keeps_numbers_only():
    stats = {"a": 1, "b": {"c": 2.5, "d": "text", "e": [1], "f": True, "g": float("nan")}, "bad key!": 3}
    assert flatten_numeric(stats) == {"a": 1.0, "b_c": 2.5, "b_f": 1.0, "bad_key_": 3.0}


def test_render_parses_and_holds_counters_and_engine_gauges():
    metrics = ServerMetrics("decode")
    metrics.observe_finished("ok", prompt_tokens=10, generated=4, cached=2, external=8)
    metrics.observe_rejected()
    metrics.ttft.observe(0.02)
    metrics.set_engine_stats({"connector": {"bytes_transferred": 4096}, "name": "x"})
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("kvbridge_requests_total", (("outcome", "ok"),))] == 1
    assert samples[("kvbridge_requests_total", (("outcome", "bad_request"),))] == 1
    assert samples[("kvbridge_prompt_tokens_total", ())] == 10
    assert samples[("kvbridge_generation_tokens_total", ())] == 4
    assert samples[("kvbridge_external_prompt_tokens_total", ())] == 8
    assert samples[("kvbridge_time_to_first_token_seconds_count", ())] == 1
    assert samples[("kvbridge_engine_connector_bytes_transferred", ())] == 4096
    assert samples[("kvbridge_node_info", (("role", "decode"),))] == 1
    assert not any(name.startswith("kvbridge_engine_name") for name, _ in samples)


def test_two_servers_in_one_process_do_not_collide():
    a, b = ServerMetrics("prefill"), ServerMetrics("decode")
    a.observe_rejected()
    assert b"outcome=\"bad_request\"" in a.render()
    assert b"outcome=\"bad_request\"" not in b.render()
