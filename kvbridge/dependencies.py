"""Third-party modules a configured feature needs, checked when it is configured, not when it first runs.

A module imported only inside the function that uses it fails on first use, deep in a transfer: in
a vLLM environment without `xxhash`, every host-tier load failed (and vLLM's `fail` policy turned
each into an HTTP 500) with nothing in the log. So a connector declares what it needs
(`KVConnectorBase.REQUIRED_MODULES`) and `connectors/factory.py` imports each one when the
connector is configured: a node's start-up, or vLLM's construction of `KVBridgeConnector`. A module
that is missing, or that fails to import, is a `MissingDependencyError` naming the feature, the
module, the pip package and the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from kvbridge.errors import MissingDependencyError

# import name -> the pip package that provides it, where they differ
PIP_PACKAGES = {"zmq": "pyzmq", "nixl": "nixl-cu12"}


def require(feature: str, modules: Iterable[str]) -> None:
    """Import each of `modules`; MissingDependencyError for the first that cannot be, naming `feature`."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # missing, or present and broken (an ABI mismatch, a failing init): both stop it
            raise missing(feature, name, exc) from None


def missing(feature: str, name: str, exc: BaseException) -> MissingDependencyError:
    """The error for `feature` when importing module `name` raised `exc`."""
    package = PIP_PACKAGES.get(name, name)
    if isinstance(exc, ModuleNotFoundError) and exc.name == name:
        why = "is not installed"
    else:
        why = f"fails to import ({type(exc).__name__}: {exc})"
    return MissingDependencyError(
        f"{feature} needs the Python module {name!r}, which {why}; install it in the environment that runs "
        f"it (pip install '{package}'; kvbridge's own install, pip install kvbridge, brings it)"
    )
