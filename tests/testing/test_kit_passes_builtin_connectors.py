"""The conformance kit passes kvbridge's own connectors, run as a plugin author runs it."""

from __future__ import annotations

import pytest
from kit_runner import run_kit

# Loads that take a moment, so that the kit can abort one in flight.
OFFLOAD = {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 64, "debug_load_delay_s": 0.05}}
PREEMPT_CHECK = "test_preempted_request_releases_blocks_after_its_stores_end"
LOAD_ERROR_CHECK = "test_load_error_becomes_a_recompute"


@pytest.mark.parametrize(
    "connector, config",
    [
        ("OffloadingConnector", {"extra": OFFLOAD["extra"]}),
        ("MultiConnector", {"extra": {"connectors": [OFFLOAD, {"connector": "OffloadingConnector",
                                                               "extra": {"host_num_blocks": 16}}]}}),
    ],
    ids=["offload", "multi"],
)  # fmt: skip
def test_kit_passes(tmp_path, connector, config):
    run = run_kit(tmp_path, connector, config)
    assert run.exit_code == 0, run.messages
    # Every check ran, but the load-error one: these connectors have no config that makes loads fail.
    assert run.outcomes.pop(LOAD_ERROR_CHECK) == "skipped"
    assert set(run.outcomes.values()) == {"passed"} and len(run.outcomes) == 10, run.outcomes


@pytest.mark.nixl
def test_kit_passes_the_nixl_connector_in_a_loopback_pair(tmp_path):
    """A prefill (kv_producer) and a decode (kv_consumer) engine in this process, NIXL over UCX on
    loopback: the decode's loads, the prefill's held blocks, an abort mid-read, flush and reset on
    both, and three create -> serve -> shutdown cycles of the pair."""
    run = run_kit(tmp_path, "NixlConnector", {"side_channel_host": "127.0.0.1"}, "--kvbridge-pair")
    assert run.exit_code == 0, run.messages
    assert run.outcomes.pop(LOAD_ERROR_CHECK) == "skipped"  # no config makes its reads fail
    assert run.outcomes.pop(PREEMPT_CHECK) == "skipped" and "pair" in run.messages[PREEMPT_CHECK]
    # The abort check ran (a fresh pair's first read waits for its handshake: it is in flight at the abort).
    assert set(run.outcomes.values()) == {"passed"} and len(run.outcomes) == 9, run.outcomes


@pytest.mark.nixl
def test_in_a_pair_the_kit_fails_a_consumer_that_reports_a_read_before_it_landed(tmp_path):
    check = "test_loads_are_finished_only_once_their_bytes_landed"
    run = run_kit(tmp_path, "planted_pair_faults:EarlyRecvNixlConnector", {}, "--kvbridge-pair", "-k", check)
    assert run.outcomes == {check: "failed"}, run.outcomes
    assert run.messages[check].startswith("kvbridge connector rule [landed-before-finished] broken:"), run.messages
