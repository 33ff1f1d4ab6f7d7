"""The conformance kit passes kvbridge's own connectors, run as a plugin author runs it."""

from __future__ import annotations

import pytest
from kit_runner import run_kit

# Loads that take a moment, so that the kit can abort one in flight.
OFFLOAD = {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 64, "debug_load_delay_s": 0.05}}


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
    assert run.outcomes.pop("test_load_error_becomes_a_recompute") == "skipped"
    assert set(run.outcomes.values()) == {"passed"} and len(run.outcomes) == 10, run.outcomes
