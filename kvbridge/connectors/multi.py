"""MultiConnector: several connectors behind one, e.g. P/D (NixlConnector) plus offload.

    KVTransferConfig(connector="MultiConnector", extra={"connectors": [
        {"connector": "NixlConnector", "role": "kv_both"},
        {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 4096}},
    ]})

Each entry of `extra["connectors"]` is a `KVTransferConfig` as a dict; missing `role`,
`engine_id`, `flush_timeout_s` and `side_channel_host` are inherited from the outer config. The
outer `side_channel_port` (`kvbridge serve --side-channel-port`) goes to the one child that listens
on a side channel (the NixlConnector of a producer); none or several such children is a ConfigError,
as is an entry's own `load_failure_policy` that differs from the outer one (the engine applies the
outer one): an option is honoured or refused, never dropped.

* loads: the first child (in list order) that offers tokens for a request serves it; the others
  see the admission with zero external tokens;
* saves: every child sees every step (its own metadata) and saves what it wants;
* `request_finished` delays freeing if any child delays; the request is reported finished-sending
  only once every child that delayed it has reported it. Which children delayed travels to the
  worker side in the metadata (`finish_plans`), since the halves share nothing else;
* `kv_transfer_params`: the children's dicts merged, earlier children winning on a clash;
* `flush` gives all children one shared deadline; `shutdown` shuts every child down.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import (
    CompletedTransfers,
    ConnectorContext,
    ConnectorRequest,
    FlushReport,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVHandoff,
    MatchResult,
    SchedulerOutput,
)
from kvbridge.connectors.factory import check_connector_config, create_connector, resolve_connector_class
from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvbridge.layout import KVCacheLayout

_INHERITED = ("role", "engine_id", "load_failure_policy", "flush_timeout_s", "side_channel_host")


@dataclass
class MultiMetadata(KVConnectorMetadata):
    children: list[KVConnectorMetadata | None]
    # Requests finished since the last step -> indices of the children that delayed their free.
    finish_plans: dict[str, tuple[int, ...]] = field(default_factory=dict)


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's configs from `config.extra["connectors"]`, each checked by its connector
    (`check_config`). Raises ConfigError naming the entry and the option it cannot honour."""
    entries = config.extra.get("connectors")
    unknown = sorted(set(config.extra) - {"connectors"})
    if unknown:
        raise ConfigError(
            f"MultiConnector: unknown extra option(s) {unknown}; its only option is extra.connectors (each child's "
            'own options go in its entry\'s "extra")'
        )
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            "MultiConnector needs extra.connectors: a non-empty list of KVTransferConfig dicts, "
            'e.g. [{"connector": "OffloadingConnector", "extra": {"host_num_blocks": 1024}}]'
        )
    children: list[KVTransferConfig] = []
    owns_port: list[bool] = []  # the entry set its own side_channel_port
    for i, entry in enumerate(entries):
        if isinstance(entry, KVTransferConfig):
            children.append(entry)
            owns_port.append(True)
            continue
        if not isinstance(entry, dict) or "connector" not in entry:
            raise ConfigError(f"MultiConnector: extra.connectors[{i}] must be a dict with a 'connector' name")
        if entry["connector"] == "MultiConnector":
            raise ConfigError("MultiConnector: a MultiConnector cannot contain another MultiConnector")
        policy = entry.get("load_failure_policy", config.load_failure_policy)
        if policy != config.load_failure_policy:
            raise ConfigError(
                f"MultiConnector: extra.connectors[{i}].load_failure_policy={policy!r} would not be applied: the "
                f"engine applies the outer KVTransferConfig.load_failure_policy ({config.load_failure_policy!r}); "
                "set it there and not in the entry"
            )
        inherited = {k: getattr(config, k) for k in _INHERITED if k not in entry}
        try:
            children.append(KVTransferConfig(**(inherited | entry)))
        except TypeError as exc:
            raise ConfigError(f"MultiConnector: extra.connectors[{i}] is not a valid KVTransferConfig: {exc}") from exc
        owns_port.append("side_channel_port" in entry)
    if config.side_channel_port:
        children = _give_port(config, children, owns_port)
    for i, child in enumerate(children):
        cls = resolve_connector_class(child.connector)
        if child.side_channel_port and owns_port[i] and cls.binds_side_channel(child) is False:
            raise ConfigError(
                f"MultiConnector: extra.connectors[{i}].side_channel_port={child.side_channel_port}: {child.connector} "
                f"in role {child.role} opens no side channel, so nothing would listen on that port; remove it"
            )
        try:
            check_connector_config(child)
        except ConfigError as exc:
            raise type(exc)(f"MultiConnector: extra.connectors[{i}] ({child.connector}): {exc}") from exc
    return children


def _give_port(config: KVTransferConfig, children: list[KVTransferConfig], owns_port: list[bool]) -> list[KVTransferConfig]:
    """`children` with the outer side_channel_port given to the one that listens on a side channel."""
    binds = [resolve_connector_class(c.connector).binds_side_channel(c) for c in children]
    takers = [i for i, b in enumerate(binds) if b is True and not owns_port[i]]
    if not takers:  # a plugin that does not say whether it listens: it may
        takers = [i for i, b in enumerate(binds) if b is None and not owns_port[i]]
    names = ", ".join(f"{c.connector} ({c.role})" for c in children)
    if not takers and any(b is not False and owns_port[i] for i, b in enumerate(binds)):
        raise ConfigError(
            f"KVTransferConfig.side_channel_port={config.side_channel_port} would not be used: the MultiConnector "
            "connector that listens sets its own side_channel_port in its entry; give the port in one place"
        )
    if not takers:
        raise ConfigError(
            f"KVTransferConfig.side_channel_port={config.side_channel_port}: none of MultiConnector's connectors "
            f"({names}) opens a side channel, so nothing would listen on that port; leave it unset"
        )
    if len(takers) > 1:
        raise ConfigError(
            f"KVTransferConfig.side_channel_port={config.side_channel_port}: MultiConnector's connectors "
            f"{', '.join(f'extra.connectors[{i}]' for i in takers)} each open a side channel and cannot share one "
            "port; give each its own side_channel_port in its entry"
        )
    return [dataclasses.replace(c, side_channel_port=config.side_channel_port) if i == takers[0] else c
            for i, c in enumerate(children)]  # fmt: skip


class MultiConnector(KVConnectorBase):
    @classmethod
    def binds_side_channel(cls, config: KVTransferConfig) -> bool | None:
        binds = [resolve_connector_class(c.connector).binds_side_channel(c) for c in child_configs(config)]
        return True if True in binds else None if None in binds else False

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        child_configs(config)  # checks every child, and where the outer side_channel_port goes

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(config, role, context)
        self.children: list[KVConnectorBase] = [create_connector(c, role, context) for c in child_configs(config)]
        self._load_owner: dict[str, int] = {}  # scheduler: req id -> child that serves its load
        self._finish_plans: dict[str, tuple[int, ...]] = {}  # scheduler: not yet sent to the worker
        self._waiting_on: dict[str, set[int]] = {}  # worker: req id -> children still to report it sent
        self._early_reports: dict[str, set[int]] = {}  # worker: reports that came before the plan

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult:
        self._load_owner.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:  # this child cannot tell yet: ask everyone again next step
                return MatchResult(None, False)
            if num_tokens > 0:
                self._load_owner[request.request_id] = i
                return MatchResult(num_tokens, load_async)
        return MatchResult(0, False)

    def external_source(self, request_id: str) -> str:
        """The source the child that matched the request's external tokens names."""
        owner = self._load_owner.get(request_id)
        return self.children[owner].external_source(request_id) if owner is not None else super().external_source(request_id)

    def take_refusal(self, request_id: str) -> str | None:
        """The first child's refusal (every child is asked, so none keeps a reason)."""
        reasons = [child.take_refusal(request_id) for child in self.children]
        return next((r for r in reasons if r is not None), None)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        owner = self._load_owner.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if i == owner else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metas = [child.build_connector_meta(scheduler_output) for child in self.children]
        plans, self._finish_plans = self._finish_plans, {}
        return MultiMetadata(metas, plans)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        # Each child gets the worker's report with its own worker half's step stats (see get_step_stats).
        for key, child in zip(self._stats_keys(), self.children):
            child.update_connector_output(dataclasses.replace(output, stats=output.stats.get(key, {})))

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        self._load_owner.pop(request.request_id, None)
        delayed_by: list[int] = []
        params: dict[str, Any] | None = None
        for i, child in enumerate(self.children):
            delay, child_params = child.request_finished(request, block_ids)
            if delay:
                delayed_by.append(i)
            if child_params:
                params = child_params | (params or {})  # earlier children win on a clash
        self._finish_plans[request.request_id] = tuple(delayed_by)
        return KVHandoff(bool(delayed_by), params)

    def has_pending_transfers(self) -> bool:
        return bool(self._finish_plans) or any(c.has_pending_transfers() for c in self.children)

    # ------------------------------------------------------------------ the plan as bytes

    def encode_metadata(self, metadata: KVConnectorMetadata) -> bytes:
        """The plan as bytes (msgspec; never pickle): each child's part through that child's own
        `encode_metadata`, so a child without one raises NotImplementedError here too."""
        assert isinstance(metadata, MultiMetadata)
        parts = [None if m is None else c.encode_metadata(m) for c, m in zip(self.children, metadata.children)]
        return msgspec.msgpack.encode((parts, metadata.finish_plans))

    def decode_metadata(self, data: bytes) -> KVConnectorMetadata:
        """Inverse of `encode_metadata`, each child's part by that child's `decode_metadata`."""
        parts, plans = msgspec.msgpack.decode(data, type=tuple[list[bytes | None], dict[str, tuple[int, ...]]])
        children = [None if p is None else c.decode_metadata(p) for c, p in zip(self.children, parts)]
        return MultiMetadata(children, plans)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        for child in self.children:
            child.register_kv_caches(kv_cache, layout)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        assert isinstance(metadata, MultiMetadata) and len(metadata.children) == len(self.children)
        for child, meta in zip(self.children, metadata.children):
            if meta is not None:
                child.bind_connector_metadata(meta)
        for req_id, delayed_by in metadata.finish_plans.items():
            early = self._early_reports.pop(req_id, set())
            if delayed_by:
                self._waiting_on[req_id] = set(delayed_by) - early

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for child in self.children:
            child.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        for child in self.children:
            child.save_kv_layer(layer)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        sending: set[str] = set()
        recving: set[str] = set()
        for i, child in enumerate(self.children):
            child_sending, child_recving = child.get_finished(finished_req_ids)
            recving |= child_recving
            for req_id in child_sending:
                waiting = self._waiting_on.get(req_id)
                if waiting is None:  # the plan has not arrived yet (or nobody delayed it)
                    self._early_reports.setdefault(req_id, set()).add(i)
                    continue
                waiting.discard(i)
        for req_id in [r for r, waiting in self._waiting_on.items() if not waiting]:
            del self._waiting_on[req_id]
            sending.add(req_id)
        return CompletedTransfers(sending, recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(child.get_block_ids_with_load_errors() for child in self.children))

    def get_load_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        for child in reversed(self.children):  # the first child's word wins: it served the load
            errors.update(child.get_load_errors())
        return errors

    def flush(self, timeout_s: float) -> FlushReport:
        deadline = time.monotonic() + timeout_s
        results = [child.flush(max(1e-3, deadline - time.monotonic())) for child in self.children]
        return FlushReport(
            all(r.is_complete for r in results),
            frozenset().union(*(r.pending_req_ids for r in results)),
            sum(r.num_failed for r in results),
        )

    def shutdown(self) -> None:
        errors = []
        for child in self.children:
            try:
                child.shutdown()
            except Exception as exc:  # noqa: BLE001 - shut the others down too, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ either side

    def _stats_keys(self) -> list[str]:
        return [f"{i}:{type(c).__name__}" for i, c in enumerate(self.children)]

    def get_step_stats(self) -> dict[str, Any]:
        return {key: c.get_step_stats() for key, c in zip(self._stats_keys(), self.children)}

    def get_stats(self) -> dict[str, Any]:
        return {key: c.get_stats() for key, c in zip(self._stats_keys(), self.children)}

    def check_integrity(self) -> None:
        for child in self.children:
            child.check_integrity()

