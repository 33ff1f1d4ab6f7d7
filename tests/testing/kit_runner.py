"""Run the conformance kit in this process, as `pytest -p kvbridge.testing --kvbridge-connector=...`
would, and collect what each of its tests reported."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class KitRun:
    exit_code: int
    outcomes: dict[str, str] = field(default_factory=dict)  # test name -> passed / failed / skipped
    messages: dict[str, str] = field(default_factory=dict)  # test name -> its failure or skip text


class _Collect:
    def __init__(self, run: KitRun) -> None:
        self.run = run

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.rpartition("::")[2]
        if report.when == "call" or report.outcome != "passed":
            self.run.outcomes[name] = report.outcome
            if report.outcome != "passed":
                self.run.messages[name] = str(report.longrepr)


def run_kit(tmp_path: Path, connector: str, config: dict | None = None, *args: str, failing: dict | None = None) -> KitRun:
    """The kit on `connector`, in an empty directory with an empty ini (none of this repo's options)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    argv = ["-p", "kvbridge.testing", "-p", "no:cacheprovider", "-q", "-c", str(tmp_path / "pytest.ini"),
            "--rootdir", str(tmp_path), f"--kvbridge-connector={connector}", *args, str(tmp_path)]  # fmt: skip
    if config is not None:
        argv += ["--kvbridge-connector-config", json.dumps(config)]
    if failing is not None:
        argv += ["--kvbridge-connector-failing-config", json.dumps(failing)]
    run = KitRun(0)
    run.exit_code = int(pytest.main(argv, plugins=[_Collect(run)]))
    return run
