"""Each check of the conformance kit can fail: a connector that breaks one rule of the contract
(planted_faults.py) fails the kit's check of that rule, with a message that names the rule.
`QueueTierConnector`, which the faulty ones derive from, passes every check."""

from __future__ import annotations

import pytest
from kit_runner import run_kit

FAST = {"extra": {"delay_s": 0.02}}
FAILING = {"extra": {"delay_s": 0.02, "fail_loads": True, "store": "failing"}}


def own_store(config: dict, tmp_path) -> dict:
    """`config` with a store of this test's own (a late copy of an abandoned run lands elsewhere)."""
    return {**config, "extra": {**config["extra"], "store": tmp_path.name}}


PREEMPT_CHECK = "test_preempted_request_releases_blocks_after_its_stores_end"


def test_the_connector_the_faults_derive_from_passes_every_check(tmp_path):
    run = run_kit(tmp_path, "planted_faults:QueueTierConnector", own_store(FAST, tmp_path), failing=FAILING)
    assert run.exit_code == 0, run.messages
    # It stores only as requests finish: no store is in flight when a request is preempted.
    assert run.outcomes.pop(PREEMPT_CHECK) == "skipped" and "loaded nothing" in run.messages[PREEMPT_CHECK]
    assert set(run.outcomes.values()) == {"passed"} and len(run.outcomes) == 10, run.outcomes


def test_a_connector_storing_while_requests_run_passes_the_preemption_check(tmp_path):
    run = run_kit(tmp_path, "planted_faults:StreamingTierConnector", own_store(FAST, tmp_path), "-k", PREEMPT_CHECK)
    assert run.outcomes == {PREEMPT_CHECK: "passed"}, run.messages


SLOW_STORES = ({"extra": {"delay_s": 1.0}}, "--kvbridge-deadline-grace", "0.3")


@pytest.mark.parametrize(
    "fault, check, rule, config_and_args",
    [
        ("EarlyFinishConnector", "test_loads_are_finished_only_once_their_bytes_landed", "landed-before-finished", ()),
        ("LateSyncLoadConnector", "test_loads_are_finished_only_once_their_bytes_landed", "landed-before-finished", ()),
        ("EarlyStoreReleaseConnector", "test_stores_release_blocks_after_reading_them", "release-after-transfer", ()),
        ("AbortReleaseConnector", "test_aborted_load_releases_blocks_after_it_ends", "release-after-transfer", ()),
        ("PreemptReleaseConnector", PREEMPT_CHECK, "release-after-transfer", ()),
        ("ResetAtOnceConnector", "test_reset_prefix_cache_waits_then_returns_true", "flush-waits-with-deadline", ()),
        ("HangingFlushConnector", "test_reset_prefix_cache_waits_then_returns_true", "flush-waits-with-deadline",
         SLOW_STORES),
        ("LeakyConnector", "test_shutdown_returns_every_byte", "shutdown-returns-everything", ()),
        ("SilentLoadErrorConnector", "test_load_error_becomes_a_recompute", "never-wrong-output", ()),
        ("LockInMetadataConnector", "test_halves_share_only_plain_metadata", "plain-metadata", ()),
        ("LaxConfigConnector", "test_bad_config_is_a_named_error_at_construction", "config-refused-at-construction", ()),
    ],
)  # fmt: skip
def test_a_planted_fault_fails_the_check_of_its_rule(tmp_path, fault, check, rule, config_and_args):
    config, *args = config_and_args or (FAST,)
    run = run_kit(tmp_path, f"planted_faults:{fault}", own_store(config, tmp_path), "-k", check, *args, failing=FAILING)
    assert run.outcomes == {check: "failed"}, run.outcomes
    assert run.messages[check].startswith(f"kvbridge connector rule [{rule}] broken:"), run.messages[check]


def test_without_the_option_the_plugin_adds_no_test(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    outcomes = []

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call":
                outcomes.append(report.nodeid)

    code = pytest.main(["-p", "kvbridge.testing", "-p", "no:cacheprovider", "-q", "-c", str(tmp_path / "pytest.ini"),
                        "--rootdir", str(tmp_path), str(tmp_path)], plugins=[Collect()])  # fmt: skip
    assert code == 0 and outcomes == ["test_one.py::test_one"]


def test_a_malformed_option_is_a_usage_error_naming_it(tmp_path, capsys):
    code = run_kit(tmp_path, "planted_faults:QueueTierConnector", None, "--kvbridge-connector-config", "{not json").exit_code
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "--kvbridge-connector-config: not JSON" in capsys.readouterr().err
