"""The conformance kit's tests: one per rule of the connector contract (`rules.py`), run on the
connector that `--kvbridge-connector` names (with `--kvbridge-pair`, on a producer and a consumer
engine, `pair.py`). A failure starts with the rule's id in brackets."""

from __future__ import annotations

import uuid

import pytest

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import KVConnectorRole
from kvbridge.errors import ConfigError
from kvbridge.testing.plugin import target_from_options
from kvbridge.testing.rules import Rule, failure_message
from kvbridge.testing.pair import abort_pair_while_loading, serve_pair, serve_pair_once
from kvbridge.testing.scenarios import (
    Served,
    abort_while_loading,
    memory_cycles,
    preempt_while_storing,
    serve_once,
    serve_twice,
)
from kvbridge.testing.target import ConnectorUnderTest, Reference, compute_reference, kit_prompts, preempt_prompts


def _check(rule: Rule, details: list[str]) -> None:
    if details:
        pytest.fail(failure_message(rule, details), pytrace=False)


@pytest.fixture(scope="session")
def kvbridge_target(pytestconfig: pytest.Config) -> ConnectorUnderTest:
    return target_from_options(pytestconfig)


@pytest.fixture(scope="session")
def kvbridge_reference() -> Reference:
    return compute_reference(kit_prompts())


@pytest.fixture(scope="session")
def served(kvbridge_target: ConnectorUnderTest, kvbridge_reference: Reference) -> Served:
    """The main scenario, run once; the checks below read what it saw."""
    serve = serve_pair if kvbridge_target.is_pair else serve_twice
    return serve(kvbridge_target, kvbridge_reference, kit_prompts())


def test_bad_config_is_a_named_error_at_construction(kvbridge_target: ConnectorUnderTest) -> None:
    key = f"kvbridge_kit_no_such_option_{uuid.uuid4().hex[:6]}"
    options = dict(kvbridge_target.options)
    options["extra"] = {**options.get("extra", {}), key: 1}
    details = []
    try:
        engine = kvbridge_target.engine(options)
    except ConfigError as exc:
        if key not in str(exc):
            details.append(f"the ConfigError does not name the unknown option {key!r}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
        details.append(f"an unknown extra option {key!r} raised {type(exc).__name__}, not ConfigError: {exc}")
    else:
        engine.shutdown()
        details.append(f"an engine was built with the unknown extra option {key!r}: check_config (or __init__) must "
                       "raise ConfigError naming it")  # fmt: skip
    _check(Rule.CONFIG_REFUSED_AT_CONSTRUCTION, details)


def test_halves_share_only_plain_metadata(served: Served) -> None:
    details = list(served.of(Rule.PLAIN_METADATA))
    for tap in served.taps:
        scheduler_half, worker_half = tap.scheduler_half, tap.worker_half
        if scheduler_half is worker_half:
            details.append("the engine got one instance for both halves")
        if (scheduler_half.role, worker_half.role) != (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            details.append(f"halves built with roles {scheduler_half.role} and {worker_half.role}")
        if not isinstance(scheduler_half.config, KVTransferConfig) or scheduler_half.config != worker_half.config:
            details.append("the two halves hold different configs; both are built from one KVTransferConfig")
    _check(Rule.PLAIN_METADATA, details)


def test_every_transfer_finishes_exactly_once(served: Served) -> None:
    _check(Rule.FINISH_ONCE, served.of(Rule.FINISH_ONCE))


def test_loads_are_finished_only_once_their_bytes_landed(served: Served) -> None:
    if not served.num_loads:
        pytest.skip("the connector loaded nothing when the kit served its prompts a second time")
    _check(Rule.LANDED_BEFORE_FINISHED, served.of(Rule.LANDED_BEFORE_FINISHED))


def test_stores_release_blocks_after_reading_them(served: Served) -> None:
    _check(Rule.RELEASE_AFTER_TRANSFER, served.of(Rule.RELEASE_AFTER_TRANSFER))


def test_aborted_load_releases_blocks_after_it_ends(kvbridge_target, kvbridge_reference) -> None:
    abort = abort_pair_while_loading if kvbridge_target.is_pair else abort_while_loading
    tap, skip = abort(kvbridge_target, kvbridge_reference, kit_prompts()[1])
    _check(Rule.RELEASE_AFTER_TRANSFER, tap.of(Rule.RELEASE_AFTER_TRANSFER))
    _check(Rule.FINISH_ONCE, tap.of(Rule.FINISH_ONCE))
    if skip:
        pytest.skip(skip)


def test_preempted_request_releases_blocks_after_its_stores_end(kvbridge_target) -> None:
    if kvbridge_target.is_pair:
        pytest.skip("a pair's consumer loads before its requests run and its producer sends after they finish: no "
                    "transfer reads a running request's blocks")  # fmt: skip
    prompts = preempt_prompts()
    tap, skip = preempt_while_storing(kvbridge_target, compute_reference(prompts), prompts)
    _check(Rule.RELEASE_AFTER_TRANSFER, tap.of(Rule.RELEASE_AFTER_TRANSFER))
    _check(Rule.LANDED_BEFORE_FINISHED, tap.of(Rule.LANDED_BEFORE_FINISHED))
    _check(Rule.NEVER_WRONG_OUTPUT, tap.of(Rule.NEVER_WRONG_OUTPUT))
    _check(Rule.FINISH_ONCE, tap.of(Rule.FINISH_ONCE))
    if skip:
        pytest.skip(skip)


def test_reset_prefix_cache_waits_then_returns_true(served: Served) -> None:
    _check(Rule.FLUSH_WAITS_WITH_DEADLINE, served.of(Rule.FLUSH_WAITS_WITH_DEADLINE))


def test_outputs_equal_an_engine_without_connector(served: Served) -> None:
    _check(Rule.NEVER_WRONG_OUTPUT, served.of(Rule.NEVER_WRONG_OUTPUT))


def test_load_error_becomes_a_recompute(kvbridge_target: ConnectorUnderTest, kvbridge_reference: Reference) -> None:
    if kvbridge_target.failing_options is None:
        pytest.skip("give --kvbridge-connector-failing-config (a config under which loads fail) to check this rule")
    serve = serve_pair if kvbridge_target.is_pair else serve_twice
    failing = serve(kvbridge_target, kvbridge_reference, kit_prompts(), kvbridge_target.failing_options)
    details = failing.of(Rule.NEVER_WRONG_OUTPUT) + failing.of(Rule.FINISH_ONCE)
    if not sum(tap.ledger.num_load_errors for tap in failing.taps):
        details.append("the failing config produced no load error (get_block_ids_with_load_errors stayed empty)")
    _check(Rule.NEVER_WRONG_OUTPUT, details)


def test_shutdown_returns_every_byte(kvbridge_target: ConnectorUnderTest) -> None:
    serve = serve_pair_once if kvbridge_target.is_pair else serve_once
    _check(Rule.SHUTDOWN_RETURNS_EVERYTHING, memory_cycles(lambda: serve(kvbridge_target, kit_prompts())))
