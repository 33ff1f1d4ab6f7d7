"""docs/serving.md's flag tables list every flag of `kvbridge serve` and `kvbridge proxy`, and no other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbridge.cli import build_parser

SERVING_MD = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def _table_flags(section: str) -> set[str]:
    """The flags named in the first column of the first `| flag | default | meaning |` table after `section`."""
    text = SERVING_MD.read_text(encoding="utf-8")
    rest = text[text.index(section) :]
    table = rest[rest.index("| flag | default | meaning |") :].split("\n\n", 1)[0]
    flags: set[str] = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        flags |= set(re.findall(r"--[a-z][a-z-]*", first_cell))
    return flags


def _parser_flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # noqa: SLF001 - argparse has no public way
    return {s for action in sub._actions for s in action.option_strings if s.startswith("--")} - {"--help"}  # noqa: SLF001


@pytest.mark.parametrize(("command", "section"), [("serve", "## `kvbridge serve`"), ("proxy", "## `kvbridge proxy`")])
def test_the_flag_table_lists_every_flag(command, section):
    documented, real = _table_flags(section), _parser_flags(command)
    assert not real - documented, f"kvbridge {command} flags missing from docs/serving.md: {sorted(real - documented)}"
    assert not documented - real, f"docs/serving.md lists flags kvbridge {command} does not have: {sorted(documented - real)}"
