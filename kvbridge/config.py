"""Frozen configs, validated in __post_init__, passed explicitly. Derived values are properties."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvbridge.errors import ConfigError, TensorParallelError

DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_KV_TOKENS = 8192  # KV cache size when CacheConfig gives neither num_blocks nor memory_fraction
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
LoadFailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in which precision, on which device."""

    model: str = "tiny"  # a built-in preset name or a local Hugging Face checkpoint directory
    dtype: str = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    seed: int = 0  # seeds the random weights of built-in presets
    max_model_len: int | None = None  # defaults to the model's own limit
    enforce_eager: bool = False  # on CUDA: run decode steps eagerly instead of replaying CUDA graphs
    # Ranks (one process each) that split the attention heads and the MLP; 1 runs in this process alone.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"ModelConfig.dtype={self.dtype!r}; expected one of {DTYPES}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"ModelConfig.device={self.device!r}; expected 'cpu', 'cuda' or 'cuda:N'")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"ModelConfig.max_model_len must be positive, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise TensorParallelError(
                f"ModelConfig.tensor_parallel_size={self.tensor_parallel_size} must be at least 1"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. Give `num_blocks`, or a `memory_fraction` of free device memory."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"CacheConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"CacheConfig.num_blocks must be at least 2, got {self.num_blocks}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"CacheConfig.memory_fraction must be in (0, 0.95], got {self.memory_fraction}")
        if self.num_blocks is not None and self.memory_fraction is not None:
            raise ConfigError("CacheConfig: give num_blocks or memory_fraction, not both")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64  # requests in one step
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    # Schedule and launch the next decode step before waiting for this one's tokens (docs/engine.md,
    # "Asynchronous scheduling"): outputs come one step() later. Without a KV connector, at TP 1.
    # None: on where it can run on a CUDA device, as vLLM does; off on the CPU, where the host's step
    # work is the step (there is no device to hide it behind).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(
                f"SchedulerConfig.async_scheduling must be True, False or None (on a CUDA device), got {self.async_scheduling!r}"
            )
        if self.max_num_seqs <= 0:
            raise ConfigError(f"SchedulerConfig.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector to run and how. `extra` carries connector-specific options.

    `connector` is a registered name (see `kvbridge.connectors.factory`), an entry point of the
    `kvbridge.connectors` group, or a `module:Class` path.
    """

    connector: str
    role: KVRole = "kv_both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port
    load_failure_policy: LoadFailurePolicy = "recompute"
    flush_timeout_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.connector:
            raise ConfigError("KVTransferConfig.connector must name a connector")
        if self.role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConfigError(
                f"KVTransferConfig.role={self.role!r}; expected 'kv_producer', 'kv_consumer' or 'kv_both'"
            )
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(
                f"KVTransferConfig.load_failure_policy={self.load_failure_policy!r}; expected 'recompute' or 'fail'"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(f"KVTransferConfig.side_channel_port={self.side_channel_port} is not a port")
        if self.flush_timeout_s <= 0:
            raise ConfigError(f"KVTransferConfig.flush_timeout_s must be positive, got {self.flush_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`, field for field (vllm/config/kv_events.py): where a node publishes
    the blocks its prefix cache stores and evicts (transfer/kv_event_publisher.py). `publisher` is
    "zmq" (or "null": nothing is published); `endpoint` is bound when it holds a `*`, `::`, or is
    ipc:// / inproc://, else connected to, as vLLM does. `prefix_caching_hash_algo` is vLLM's
    CacheConfig field of that name: here it decides only the hashes the events carry."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's default)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond it a batch is dropped
    topic: str = ""
    prefix_caching_hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"KV events publisher {self.publisher!r}: expected 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KV events config {name}={value!r} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ConfigError(f"KV events endpoint {self.endpoint!r} is not a ZMQ address such as tcp://*:5557")
        if self.replay_endpoint is not None and "://" not in str(self.replay_endpoint):
            raise ConfigError(f"KV events replay_endpoint {self.replay_endpoint!r} is not a ZMQ address")

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse vLLM's `--kv-events-config` JSON; an unknown key or a value of the wrong type is a ConfigError."""
        import json
        from dataclasses import fields

        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError('--kv-events-config must be a JSON object, e.g. \'{"enable_kv_cache_events": true}\'')
        known = {f.name for f in fields(cls)} - {"prefix_caching_hash_algo"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        for key in ("enable_kv_cache_events",):
            if key in raw and not isinstance(raw[key], bool):
                raise ConfigError(f"--kv-events-config: {key} must be true or false, got {raw[key]!r}")
        for key in ("endpoint", "topic"):
            if key in raw and not isinstance(raw[key], str):
                raise ConfigError(f"--kv-events-config: {key} must be a string, got {raw[key]!r}")
        return cls(**raw)


# Connectors whose worker half runs on every tensor-parallel rank (connectors/base.py,
# `supports_tensor_parallel`); named here because configs import no connector.
TP_AWARE_CONNECTORS = frozenset({"NixlConnector"})


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is built from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig | None = None
    kv_events: KVEventsConfig | None = None  # None: no KV events (engine/kv_events.py)

    def __post_init__(self) -> None:
        if self.kv_events is not None and self.kv_events.is_publishing and not self.cache.enable_prefix_caching:
            raise ConfigError(
                "KV events describe the prefix cache, and prefix caching is off: enable it, or drop the events config"
            )
        tp = self.model.tensor_parallel_size
        if tp > 1 and self.kv_transfer is not None and self.kv_transfer.connector not in TP_AWARE_CONNECTORS:
            # A connector runs one worker half per rank under TP (engine/tp_connector.py); only those
            # written for it (each rank moving its own heads, the node's leases on rank 0) are built.
            raise TensorParallelError(
                f"ModelConfig.tensor_parallel_size={tp} with KVTransferConfig.connector="
                f"{self.kv_transfer.connector!r} is not supported: of the connectors, only {sorted(TP_AWARE_CONNECTORS)} "
                "run with tensor parallelism; use one of them, run without a connector, or with tensor_parallel_size 1"
            )
