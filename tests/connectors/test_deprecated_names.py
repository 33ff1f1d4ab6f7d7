"""The connector answers' earlier names still import from kvbridge.connectors.base, with a warning."""

from __future__ import annotations

import pytest

from kvbridge.connectors import base


@pytest.mark.parametrize(
    ("old", "new"),
    [("FinishResult", "KVHandoff"), ("FinishedTransfers", "CompletedTransfers"), ("FlushResult", "FlushReport")],
)
def test_old_name_is_the_new_type_and_warns(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"use {new}"):
        assert getattr(base, old) is getattr(base, new)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        base.NoSuchAnswer  # noqa: B018
