"""kvbridge's conformance kit for connector plugin authors: a pytest plugin.

    pytest --kvbridge-connector=my_pkg.module:MyConnector --kvbridge-connector-config '{"extra": {...}}'

drives the connector through the reference engine on CPU (the tiny model) and checks each rule of
the connector contract (`rules.py`) as a test of its own; `--kvbridge-pair` runs a P/D connector as
a producer engine and a consumer engine (`pair.py`). The plugin is registered in the `pytest11`
entry-point group under this module's name, so an installed kvbridge offers the options in every
pytest run; `-p kvbridge.testing` loads it where entry points are off. It adds tests only when
`--kvbridge-connector` is given. docs/connector-api.md, "The conformance kit", explains each check.
"""

from kvbridge.testing.plugin import pytest_addoption, pytest_configure

__all__ = ["pytest_addoption", "pytest_configure"]
