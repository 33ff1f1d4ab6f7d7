"""The KV connector API: how a transport or a memory tier plugs into the engine.

The shape follows vLLM's V1 KV connector API. One connector class implements two halves, and
the engine builds one instance per half from the same `KVTransferConfig`:

* the **scheduler side** (`role=KVConnectorRole.SCHEDULER`) lives in the scheduler. It is pure
  bookkeeping: it decides which tokens come from outside, records which blocks they land in, and
  emits a `KVConnectorMetadata` each step telling the worker what to load and save. It must never
  block or do I/O.
* the **worker side** (`role=KVConnectorRole.WORKER`) lives next to the KV cache tensor, in the
  model runner. It moves bytes and reports what finished.

The two halves talk only through `KVConnectorMetadata` (scheduler -> worker, once per step) and
`KVConnectorOutput` (worker -> scheduler, once per step), so they may live in different
processes. Every method is called on the engine thread unless its docstring says otherwise.

This module is the whole contract: the connector class, every type its methods take or return
(`SchedulerOutput`, `KVConnectorOutput`, the answers), and the `SchedulerHalf` / `WorkerHalf`
protocols a connector written as two plain objects implements (see `split.py`). The engine
imports these types from here; nothing here depends on the engine: a connector reads a request
through `ConnectorRequest`, which the engine's `Request` and the vLLM integration's view both satisfy.

Per-step order, driven by `EngineCore.step()`:

    scheduler: get_num_new_matched_tokens -> update_state_after_alloc   (per admitted request)
               build_connector_meta(scheduler_output)
    worker:    bind_connector_metadata -> start_load_kv
               forward, with wait_for_layer_load(i) / save_kv_layer(i) around layer i
               wait_for_save -> get_finished -> get_block_ids_with_load_errors -> get_landed_recving
               clear_connector_metadata
    scheduler: update_connector_output(KVConnectorOutput)
               request_finished(request, block_ids)             (per finished request)
"""

from __future__ import annotations

import enum
import secrets
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

from kvbridge.config import KVTransferConfig
from kvbridge.errors import ConfigError
from kvbridge.transfer.progress import Wakeup

if TYPE_CHECKING:
    import torch

    from kvbridge.block_hash import BlockHash
    from kvbridge.layout import KVCacheLayout


class KVConnectorRole(enum.Enum):
    SCHEDULER = enum.auto()
    WORKER = enum.auto()


class RequestStatus(enum.Enum):
    """Where a request is in its life. Declared here, not in the engine, because connectors read it:
    a producer hands a finished request's KV on only when it finished normally."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, an async KV load in flight
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # e.g. a KV load failed under the `fail` policy

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value


class ConnectorRequest(Protocol):
    """What a connector reads from a request, and all it may read: the engine's `Request` and the
    vLLM integration's `RequestView` both provide it, so a connector works under either engine."""

    @property
    def request_id(self) -> str: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...

    @property
    def status(self) -> RequestStatus: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...  # prompt and output tokens so far

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...  # chained hashes of every full block so far

    def prompt_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks at another engine's `block_size`, as this engine
        would hash them (namespace, extra keys): what identifies a prefill's blocks of another size."""
        ...


@dataclass(frozen=True)
class ConnectorContext:
    """What the engine tells a connector about itself when building it."""

    model_id: str  # identifies the weights; part of the handshake compatibility hash
    block_size: int
    device: str  # device of the KV cache ("cpu", "cuda:0", ...)
    hash_namespace: str = ""  # namespace of the chained block hashes (see kvbridge/block_hash.py)
    layout: KVCacheLayout | None = None  # the KV cache geometry, when the engine knows it at build time
    # Random per context, so both halves built from one context share it: peers tell a restarted
    # engine on the same address from the one that answered before (the NixlConnector's leases).
    incarnation: str = field(default_factory=lambda: secrets.token_hex(16))
    # Rung by a connector's own threads when something finished that the next step should see (a
    # peer's answer, a copy): the engine's idle wait then ends at once instead of at its next poll.
    wakeup: Wakeup = field(default_factory=Wakeup)
    # Tensor parallelism: this worker half serves rank `tp_rank` of `tp_size`, whose KV cache holds the
    # model's KV heads [kv_head_start, kv_head_start + layout.num_kv_heads) of `num_total_kv_heads`
    # (None: all of them). Every rank's cache uses the same block ids (rank 0's scheduler allocates for
    # all), so block b of every rank holds the same tokens, each rank its own heads of them.
    tp_rank: int = 0
    tp_size: int = 1
    kv_head_start: int = 0
    num_total_kv_heads: int | None = None


class KVConnectorMetadata:
    """Base of the per-step plan a scheduler side hands its worker side.

    Subclasses hold plain data (ids, block ids, hashes) so the plan could cross a process boundary.
    """


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) are computed."""

    # The scheduler's object: the engine's Request, of which the model runner reads more; connectors
    # read what ConnectorRequest names. Neither mutates it.
    request: ConnectorRequest
    start: int  # request.num_computed_tokens before this step
    num_new_tokens: int
    block_ids: list[int]  # every block the request holds, in token order, after this step's allocation


@dataclass
class SchedulerOutput:
    """One step's batch, as `build_connector_meta` sees it (and the model runner runs it)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that finished or were aborted since the last step: per-request worker state can go.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # False: the engine runs no model in this step (for no request, also none left out of `scheduled`)
    # and polls its connectors again only some time after it (vLLM: ~1 ms), so a connector may wait
    # in it for a transfer about to end, holding up nothing. None: not said (the reference engine,
    # whose idle waits its connectors end by ringing its Wakeup).
    runs_model: bool | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports back to the scheduler after a step."""

    finished_sending: set[str] = field(default_factory=set)  # delay-freed blocks may now be freed
    finished_recving: set[str] = field(default_factory=set)  # async loads done: the request may run
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose load failed
    load_errors: dict[str, str] = field(default_factory=dict)  # request id -> why its load failed (one line)
    stats: dict[str, Any] = field(default_factory=dict)
    # Async loads whose bytes landed but are not vouched for yet (get_landed_recving): the scheduler
    # may compute after them, holding back what that computes until `finished_recving` names them.
    landed_recving: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class MatchResult(NamedTuple):
    """Answer of `get_num_new_matched_tokens`.

    `num_external_tokens` is None when the connector cannot tell yet (e.g. a lookup in flight):
    the scheduler then leaves the request waiting and asks again next step.
    """

    num_external_tokens: int | None
    load_async: bool


class KVHandoff(NamedTuple):
    """Answer of `request_finished`: what becomes of a finished request's KV, whether its blocks
    outlive it and what the client is told to fetch it by."""

    delay_free_blocks: bool  # True: the scheduler frees the blocks only once get_finished reports the request
    kv_transfer_params: dict[str, Any] | None  # returned to the client with the request's output


class CompletedTransfers(NamedTuple):
    """Answer of `get_finished`: request ids whose sends / receives completed since the last call."""

    finished_sending: set[str]
    finished_recving: set[str]


class FlushReport(NamedTuple):
    """Answer of `flush`: how far draining the in-flight transfers got by the deadline.

    `is_complete` is True when nothing is in flight any more. `pending_req_ids` names the requests
    whose transfers are still in flight at the deadline; `num_failed` counts transfers that ended in
    failure while flushing (their requests are reported through the usual error paths).
    """

    is_complete: bool
    pending_req_ids: frozenset[str] = frozenset()
    num_failed: int = 0


# The answers' earlier names (`FinishResult`, `FinishedTransfers`, `FlushResult` read alike but
# mean different things); connectors written against them still import, with a DeprecationWarning.
_DEPRECATED_NAMES = {
    "FinishResult": "KVHandoff",
    "FinishedTransfers": "CompletedTransfers",
    "FlushResult": "FlushReport",
}


def __getattr__(name: str) -> Any:
    new_name = _DEPRECATED_NAMES.get(name)
    if new_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: use {new_name}", DeprecationWarning, stacklevel=2)
    return globals()[new_name]


class KVConnectorBase(ABC):
    """A KV connector. Subclasses implement both halves; `self.role` says which one this instance is."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        self.config = config
        self.role = role
        self.context = context

    # ------------------------------------------------------------------ configuration (class level)

    # Third-party modules the connector needs (import names), imported when it is configured
    # (factory.check_connector_config, kvbridge/dependencies.py): a missing or broken one is a
    # MissingDependencyError at start-up, not a failure of every transfer that first uses it.
    REQUIRED_MODULES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def binds_side_channel(cls, config: KVTransferConfig) -> bool | None:
        """Whether a connector built from `config` listens on `config.side_channel_port`: True, False,
        or None when the class does not say (the default, so a plugin's own use of the port is never
        refused). A non-zero port given to a connector that answers False is refused when the
        connector is built: nothing would listen on it. Pure; called before any instance exists."""
        return None

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Raise ConfigError for anything in `config` this connector cannot honour (an unknown or
        invalid `extra` option, a port it would not bind), so a server refuses it at start-up, before
        it binds or builds anything. Pure. Subclasses that validate `extra` extend it (call super)."""
        if config.side_channel_port and cls.binds_side_channel(config) is False:
            raise ConfigError(
                f"KVTransferConfig.side_channel_port={config.side_channel_port}: {config.connector} in role "
                f"{config.role} opens no side channel, so nothing would listen on that port; leave it unset "
                "(only a node that serves KV to peers, a producer, listens)"
            )

    # ------------------------------------------------------------------ scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult:
        """How many tokens beyond the local prefix hit the connector can provide.

        Called by the scheduler for a waiting request before it allocates blocks; `num_computed_tokens`
        is the local prefix-cache hit (a multiple of the block size). The answer must leave at least
        the last prompt token to compute. `load_async=True` parks the request in
        `WAITING_FOR_REMOTE_KVS` until the worker reports it in `finished_recving`; with False the
        worker loads it inside this step's `start_load_kv`, before the forward pass. May be called
        again for the same request in a later step (if it could not be admitted).
        """

    def external_source(self, request_id: str) -> str:
        """Where the external tokens just matched for a request come from: "peer" (another engine's
        KV, pulled), "host_tier" or "disk_tier" (this engine's offload tiers), or a word of the
        connector's own. Called by the scheduler right after `get_num_new_matched_tokens` matched
        external tokens for the request; the request's answer reports it (`kv_external_source`).
        The default, "external", says only that a connector supplied them.
        """
        return "external"

    def take_refusal(self, request_id: str) -> str | None:
        """Why this connector refused the external KV a request's params named (a peer outside
        `allowed_peers`, blocks that are not the prompt's, malformed params), in one line, or None.

        Called by the scheduler right after `get_num_new_matched_tokens` matched no external token for
        the request; the reason is handed over once (the request's answer reports it), so the
        connector forgets it. The default refuses nothing.
        """
        return None

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the blocks that external tokens will land in.

        Called by the scheduler once blocks were allocated for a request admitted with a non-zero
        (or any, for producers that want to see every admission) `num_external_tokens`. `block_ids` are all
        the request's blocks in token order; the external tokens fill those after the local hit.
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The worker's plan for this step (what to load, what to save). Resets per-step state.

        Called by the scheduler once per step, after scheduling, before the model runs.
        """

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn what the worker finished (sends, receives, load errors, stats).

        Called by the scheduler once per step after the model ran, before finished requests are freed.
        """

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        """A request finished or was aborted; decide whether its blocks must outlive it.

        Called by the scheduler once per request. With `delay_free_blocks=True` the scheduler keeps the
        blocks until the worker reports the request in `finished_sending` (a transfer or store in flight).
        """
        return KVHandoff(False, None)

    def has_pending_transfers(self) -> bool:
        """True while any request this side knows of still waits on a transfer."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        """The engine's KV cache tensor and its geometry: a view `[num_blocks, num_layers, *page_shape]`
        with `layout.strides` (block-major in kvbridge's engine; layer-major over vLLM's buffer, see
        `kvbridge/layout.py`). Byte arithmetic goes through the layout, never through the tensor's shape.
        An engine that allocates each layer alone (vLLM 0.25's V2 model runner) hands a
        `kvbridge.layer_tensors.LayerTensors` instead, with a `KVCacheLayout.per_layer` layout: it
        gathers and scatters whole blocks (`index_select`, `index_copy_`) but is no tensor; a connector
        that needs one view refuses it with a `ConfigError`.

        Called by the model runner once, after allocating the cache and before the first step.
        The connector may register the memory with a transport. It must drop every reference to
        `kv_cache` in `shutdown()`.
        """

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """This step's plan. Called by the model runner at the start of each step."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Called by the model runner at the end of each step."""
        self._metadata = None

    def get_connector_metadata(self) -> KVConnectorMetadata | None:
        return getattr(self, "_metadata", None)

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start this step's loads. Synchronous loads (load_async=False) must be done when the
        corresponding `wait_for_layer_load` returns; async loads are polled by `get_finished`."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer `layer` of this step's synchronous loads is in the KV cache.

        Called by the model runner before layer `layer` reads the cache.
        """

    def save_kv_layer(self, layer: int) -> None:
        """Layer `layer` of this step has been written to the KV cache.

        Called by the model runner after layer `layer` ran. Must not block the forward pass.
        """

    @abstractmethod
    def wait_for_save(self) -> None:
        """Called by the model runner after the forward pass. A connector whose stores must be
        complete before blocks are reused waits here, or reports them as pending through
        `request_finished` / `get_finished` instead of waiting."""

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        """Request ids whose sends / receives completed since the last call. Must not block.

        Called by the model runner once per step; `finished_req_ids` are the requests the scheduler
        finished since the last step.
        """
        return CompletedTransfers(set(), set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; the scheduler recomputes or fails their requests."""
        return set()

    def get_landed_recving(self) -> set[str]:
        """Async loads whose bytes are all in their blocks, with no write to them still in flight,
        but not yet confirmed: each is named once, before `get_finished` names it in `finished_recving`.

        Called by the model runner once per step, after `get_block_ids_with_load_errors`. The
        scheduler may then compute the request's tokens after the loaded prefix on those bytes, and
        holds back everything that computation yields (sampled tokens, prefix-cache hashes) until
        `finished_recving` names the request without a load error; a load error for any of its
        blocks discards it and the request recomputes. A connector must therefore report every
        later doubt about these bytes (a refused confirmation, a digest mismatch) as a load error
        with its `finished_recving`. Optional: the default names none (nothing is computed early).
        """
        return set()

    def get_load_errors(self) -> dict[str, str]:
        """Request id -> why its load failed (one line, e.g. "... AuthenticationError: ..."), for the
        loads that failed since the last call. Called right after `get_block_ids_with_load_errors`;
        the engine reports the reason in the request's output. Optional: the default reports none."""
        return {}

    def flush(self, timeout_s: float) -> FlushReport:
        """Drive every in-flight transfer to completion or failure, waiting at most `timeout_s`.

        Called by the engine before `reset_prefix_cache` touches blocks and before `shutdown`. Must
        return by the deadline, reporting what is still in flight; never "not yet" forever. Results
        (finished sends/receives, load errors) are reported by the following `get_finished` and
        `get_block_ids_with_load_errors` calls as usual.
        """
        return FlushReport(True)

    def shutdown(self) -> None:
        """Release everything: deregister memory from transports before it is freed, release
        transfer handles, stop threads, close sockets, drop references to KV tensors.

        Called by the engine after `flush`, on either side. Idempotent.
        """

    def get_step_stats(self) -> dict[str, Any]:
        """What the worker side tells its scheduler side this step; it arrives as `KVConnectorOutput.stats`.

        Called by the model runner once per step, on the hot path: return only what the scheduler
        side needs (e.g. an address the worker bound), never summaries computed over history.
        """
        return {}

    def get_stats(self) -> dict[str, Any]:
        """Counters and latency summaries (bytes moved, transfers, failures, ...). Either side.

        Called on demand (`EngineCore.get_stats()`, the server's /metrics), not every step.
        """
        return {}

    # ------------------------------------------------------------------ tensor parallelism (worker side)
    #
    # Under tensor parallelism every rank's process holds a worker half over its own heads' cache, and
    # rank 0's model runner drives the others (engine/tp_connector.py), in this order:
    #   once, after register_kv_caches on every rank: rank 0 `set_tp_rank_infos(every other rank's tp_rank_info())`
    #   each step: rank 0 `encode_metadata` -> ranks > 0 `decode_metadata`, bind, start_load_kv, ...,
    #   wait_for_save; ranks > 0 `tp_step_report()` -> rank 0 `apply_tp_step_reports`, then every rank's
    #   get_finished / load errors are merged: a request is finished when every rank finished it, and a
    #   load error on any rank is a load error for the request.
    # Only connectors with `supports_tensor_parallel` are built under TP (EngineConfig refuses the rest).

    supports_tensor_parallel: ClassVar[bool] = False

    def encode_metadata(self, metadata: KVConnectorMetadata) -> bytes:
        """This step's metadata as bytes for the other ranks (msgspec; never pickle). Rank 0, each step."""
        raise NotImplementedError(f"{type(self).__name__} does not run under tensor parallelism")

    def decode_metadata(self, data: bytes) -> KVConnectorMetadata:
        """Inverse of `encode_metadata`. Ranks > 0, each step."""
        raise NotImplementedError(f"{type(self).__name__} does not run under tensor parallelism")

    def tp_rank_info(self) -> bytes:
        """What this rank tells rank 0 once its KV cache is registered (e.g. its transport's metadata)."""
        return b""

    def set_tp_rank_infos(self, infos: list[bytes]) -> None:
        """Rank 0: the `tp_rank_info` of ranks 1..N-1, in rank order. Called once, before the first step."""

    def tp_step_report(self) -> bytes:
        """Ranks > 0, after each step's wait_for_save: connector-specific news for rank 0."""
        return b""

    def has_tp_step_report(self, metadata: KVConnectorMetadata | None) -> bool:
        """Whether a step that bound `metadata` may give ranks > 0 a `tp_step_report` (or rank 0 a reason to
        wait for one). Any rank, before that step's exchange. A pure function of the metadata, which every
        rank binds alike: where all ranks answer False, a driver that exchanges by collective (the vLLM
        adapter) skips the exchange on all of them together. Default: every step."""
        return True

    def apply_tp_step_reports(self, reports: list[bytes]) -> None:
        """Rank 0, after each step's wait_for_save and before its get_finished: ranks 1..N-1's reports."""

    def check_integrity(self) -> None:
        """Raise AssertionError if this half's own bookkeeping no longer balances. Either side.

        Called by `EngineCore.check_integrity()` (tests, the server's admin state), never on the
        step path; the default checks nothing.
        """


class SchedulerHalf(Protocol):
    """The scheduler half of a connector written as two plain objects (`split.SplitConnector`).

    Each method means what the `KVConnectorBase` method of the same name means. May also define
    `check_integrity()`, `take_refusal()` and `external_source()` (see `KVConnectorBase`).
    """

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult: ...

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff: ...

    def has_pending_transfers(self) -> bool: ...

    def get_stats(self) -> dict[str, Any]: ...


class WorkerHalf(Protocol):
    """The worker half of a connector written as two plain objects (`split.SplitConnector`).

    `metadata` is this step's plan, or None when the step carried none of the connector's
    `metadata_type`; the half never sees `bind_connector_metadata`. The other methods mean what
    the `KVConnectorBase` methods of the same names mean. May also define `get_step_stats()` and
    `check_integrity()`.
    """

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None: ...

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None: ...

    def wait_for_save(self, metadata: KVConnectorMetadata | None) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def flush(self, timeout_s: float) -> FlushReport: ...

    def shutdown(self) -> None: ...

    def get_stats(self) -> dict[str, Any]: ...
