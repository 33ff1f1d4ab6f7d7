"""Find connectors by name.

Three sources, in this order:
1. built-ins, registered below by lazy "module:Class" path so their optional dependencies
   (nixl, ...) are imported only when that connector is built;
2. plugins that installed packages declare in the `kvbridge.connectors` entry-point group:

       [project.entry-points."kvbridge.connectors"]
       MyConnector = "my_package.connector:MyConnector"

3. a "module:Class" path given directly as the connector name.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import ConnectorContext, KVConnectorBase, KVConnectorRole
from kvbridge.dependencies import missing, require
from kvbridge.errors import ConnectorNotFoundError

ENTRY_POINT_GROUP = "kvbridge.connectors"

_REGISTRY: dict[str, str] = {}


def register_connector(name: str, target: str) -> None:
    """Register `target` ("module:Class") under `name`. Re-registering a name replaces it."""
    if ":" not in target:
        raise ValueError(f"connector target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = target


register_connector("NixlConnector", "kvbridge.connectors.nixl.connector:NixlConnector")
register_connector("OffloadingConnector", "kvbridge.connectors.offload.connector:OffloadingConnector")
register_connector("MultiConnector", "kvbridge.connectors.multi:MultiConnector")


def _plugin_targets() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_connectors() -> list[str]:
    """Every connector name that `resolve_connector_class` accepts, built-ins first."""
    return list(_REGISTRY) + sorted(set(_plugin_targets()) - set(_REGISTRY))


def _load(target: str, name: str) -> type[KVConnectorBase]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except ModuleNotFoundError as exc:
        if exc.name and not module_name.startswith(exc.name) and not exc.name.startswith(("kvbridge.", module_name)):
            raise missing(f"connector {name!r}", exc.name, exc) from None  # a dependency of the connector's module
        raise ConnectorNotFoundError(f"connector {name!r} points at {target!r}, which cannot be loaded: {exc}") from exc
    except (ImportError, AttributeError) as exc:
        raise ConnectorNotFoundError(f"connector {name!r} points at {target!r}, which cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ConnectorNotFoundError(f"connector {name!r} ({target}) is not a KVConnectorBase subclass")
    return cls


def resolve_connector_class(name: str) -> type[KVConnectorBase]:
    if name in _REGISTRY:
        return _load(_REGISTRY[name], name)
    plugins = _plugin_targets()
    if name in plugins:
        return _load(plugins[name], name)
    if ":" in name:
        return _load(name, name)
    raise ConnectorNotFoundError(
        f"unknown connector {name!r}; available: {', '.join(available_connectors())} "
        f"(or give a 'module:Class' path, or install a plugin in the {ENTRY_POINT_GROUP!r} entry-point group)"
    )


def check_connector_config(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The connector class `config.connector` names, once it has checked that its dependencies import
    (`REQUIRED_MODULES`) and that it can honour every option in `config` (`KVConnectorBase.check_config`).
    Raises MissingDependencyError naming the module, or ConfigError naming the option."""
    cls = resolve_connector_class(config.connector)
    require(f"connector {config.connector!r}", cls.REQUIRED_MODULES)
    cls.check_config(config)
    return cls


def create_connector(config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> KVConnectorBase:
    """Build one half (`role`) of the connector that `config.connector` names; an option it cannot
    honour is a ConfigError, never silently dropped."""
    return check_connector_config(config)(config, role, context)
