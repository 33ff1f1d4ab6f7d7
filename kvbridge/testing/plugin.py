"""The conformance kit's pytest hooks: its command-line options, and the kit's tests added to the
session when `--kvbridge-connector` is given. Without that option the plugin adds nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFORMANCE_TESTS = Path(__file__).with_name("conformance.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvbridge", "kvbridge connector conformance kit (docs/connector-api.md)")
    group.addoption("--kvbridge-connector", metavar="NAME", default=None,
                    help="run the conformance kit on this connector: a registered name, an entry point of the "
                         "kvbridge.connectors group, or module:Class")  # fmt: skip
    group.addoption("--kvbridge-connector-config", metavar="JSON", default=None,
                    help='its KVTransferConfig fields but "connector", e.g. \'{"extra": {"dir": "/tmp/kv"}}\'')
    group.addoption("--kvbridge-connector-failing-config", metavar="JSON", default=None,
                    help="a config (same form) under which its loads fail: checks that a load error becomes a "
                         "recompute (skipped without it)")  # fmt: skip
    group.addoption("--kvbridge-first-params", metavar="JSON", default=None,
                    help="kv_transfer_params of the first pass (a P/D producer: '{\"do_remote_decode\": true}')")
    group.addoption("--kvbridge-pair", action="store_true", default=False,
                    help="a P/D connector: run it as a producer engine and a consumer engine in this process, the "
                         "consumer loading what the producer computed")  # fmt: skip
    group.addoption("--kvbridge-deadline-grace", metavar="SECONDS", type=float, default=10.0,
                    help="how long past its own deadline a wait may run before the kit calls it a hang (default 10)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("kvbridge_connector") is None:
        return
    from kvbridge.errors import ConfigError

    try:
        target_from_options(config)
    except ConfigError as exc:
        raise pytest.UsageError(f"kvbridge conformance kit: {exc}") from exc
    config.args.append(str(CONFORMANCE_TESTS))


def target_from_options(config: pytest.Config):
    """The ConnectorUnderTest the command line names (ConfigError for a malformed option)."""
    from kvbridge.testing.target import ConnectorUnderTest

    return ConnectorUnderTest.parse(
        config.getoption("kvbridge_connector"),
        config.getoption("kvbridge_connector_config"),
        config.getoption("kvbridge_connector_failing_config"),
        config.getoption("kvbridge_first_params"),
        config.getoption("kvbridge_deadline_grace"),
        config.getoption("kvbridge_pair"),
    )
