"""The example plugin (examples/kvbridge-file-tier), a package of its own, passes the conformance
kit. CI installs it (.ci/run), so the kit finds it by its entry point, as a user's pytest would;
where it is not installed the kit is given its module:Class path."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from kit_runner import run_kit

from kvbridge.connectors import factory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvbridge-file-tier"


def _is_installed() -> bool:
    try:
        distribution("kvbridge-file-tier")
    except PackageNotFoundError:
        return False
    return True


def test_kit_passes_the_example_plugin(tmp_path, monkeypatch):
    if _is_installed():
        name = "FileTierConnector"
    else:
        monkeypatch.syspath_prepend(str(EXAMPLE))
        name = "kvbridge_file_tier.connector:FileTierConnector"
    config = {"extra": {"dir": str(tmp_path / "files")}}
    failing = {"extra": {"dir": str(tmp_path / "failing"), "debug_fail_loads": True}}
    run = run_kit(tmp_path, name, config, failing=failing)
    assert run.exit_code == 0, run.messages
    # It stores as requests finish: no store is in flight when a request is preempted.
    assert run.outcomes.pop("test_preempted_request_releases_blocks_after_its_stores_end") == "skipped"
    # Its loads are file reads: one may end within the step that starts it (seen once in a clean CI run), and
    # the kit then has no load in flight to abort. That skip, and only that one, is not the plugin's fault.
    aborted = "test_aborted_load_releases_blocks_after_it_ends"
    if run.outcomes.get(aborted) == "skipped":
        assert "ended within its first step" in run.messages[aborted], run.messages[aborted]
        run.outcomes[aborted] = "passed"
    assert set(run.outcomes.values()) == {"passed"} and len(run.outcomes) == 10, run.outcomes


@pytest.mark.skipif(not _is_installed(), reason="pip install -e examples/kvbridge-file-tier (CI does)")
def test_the_example_plugin_is_found_by_its_entry_point():
    assert "FileTierConnector" in factory.available_connectors()
    cls = factory.resolve_connector_class("FileTierConnector")
    assert Path(cls.__module__.replace(".", "/") + ".py").name == "connector.py"
    assert Path(__import__(cls.__module__, fromlist=["_"]).__file__).resolve().is_relative_to(EXAMPLE)
