"""Connector options from `KVTransferConfig.extra`, one way for every connector."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from kvbridge.errors import ConfigError

T = TypeVar("T")


def options_from_extra(cls: type[T], extra: dict[str, Any], connector: str) -> T:
    """Build the options dataclass `cls` (validated in its __post_init__) from `extra`.

    An unknown key is a ConfigError that names the known ones: a typo never passes silently.
    """
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(
            f"{connector}: unknown extra option(s) {unknown} in KVTransferConfig.extra; known: {sorted(known)}"
        )
    return cls(**extra)
