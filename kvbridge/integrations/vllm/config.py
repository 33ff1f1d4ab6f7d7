"""vLLM's configuration -> the kvbridge connector config and context it describes.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"connector": "NixlConnector", "lease_s": 30}}'

`kv_connector_extra_config["connector"]` names any kvbridge connector (a built-in, a plugin, or a
`module:Class` path); `side_channel_host`, `side_channel_port` and `flush_timeout_s` there are
`KVTransferConfig` fields; every other key is that connector's own option (its `extra`). The role
and the engine id are vLLM's, and so is the load failure policy (`kv_load_failure_policy`): vLLM
applies it, kvbridge's own would never be consulted. The connector checks the whole config when
vLLM builds the adapter (`check_connector_config`): an option it cannot honour (an unknown key, a
`side_channel_port` for a role that opens no side channel) is a ConfigError naming the key.

Pure Python; vLLM's config objects are read by attribute only.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from kvbridge.config import TP_AWARE_CONNECTORS, KVTransferConfig
from kvbridge.connectors.factory import check_connector_config
from kvbridge.errors import ConfigError, PipelineParallelError, TensorParallelError
from kvbridge.transfer.interfaces import advertised_host

# Keys of kv_connector_extra_config that are KVTransferConfig fields rather than connector options.
_CONFIG_FIELDS = ("side_channel_host", "side_channel_port", "flush_timeout_s")
# Fields vLLM owns: set in vLLM's own config, never in the extra config.
_VLLM_OWNED = {
    "role": "kv_role",
    "engine_id": "engine_id",
    "load_failure_policy": "kv_load_failure_policy",
}


@dataclass(frozen=True)
class AdapterConfig:
    """Everything the adapter derives from vLLM's config, on either side."""

    transfer: KVTransferConfig
    model_id: str  # identity of the weights; also the namespace of the chained block hashes
    block_size: int
    tp_size: int = 1  # vLLM's workers: one worker half (a kvbridge rank) in each

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> AdapterConfig:
        kv = vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config or {})
        connector = extra.pop("connector", None)
        if not connector or not isinstance(connector, str):
            raise ConfigError(
                "KVBridgeConnector needs kv_connector_extra_config.connector: the kvbridge connector to run, "
                'e.g. {"connector": "NixlConnector"} or {"connector": "OffloadingConnector", "host_capacity_bytes": 4294967296}'
            )
        for ours, theirs in _VLLM_OWNED.items():
            if ours in extra:
                raise ConfigError(
                    f"kv_connector_extra_config.{ours} is vLLM's to set: use --kv-transfer-config's {theirs!r} instead"
                )
        fields = {name: extra.pop(name) for name in _CONFIG_FIELDS if name in extra}
        if "side_channel_host" in fields:  # peers connect to it: a wildcard becomes a reachable address
            fields["side_channel_host"] = advertised_host(str(fields["side_channel_host"]), None)
        try:
            transfer = KVTransferConfig(
                connector=connector,
                role=kv.kv_role or "kv_both",
                engine_id=str(kv.engine_id),
                load_failure_policy=kv.kv_load_failure_policy,
                extra=extra,
                **fields,
            )
        except TypeError as exc:
            raise ConfigError(f"KVBridgeConnector: invalid kv_connector_extra_config: {exc}") from exc
        try:
            connector_class = check_connector_config(transfer)
        except ConfigError as exc:
            raise type(exc)(f"KVBridgeConnector: kv_connector_extra_config: {extra_config_names(str(exc))}") from exc
        check_parallelism(vllm_config.parallel_config, connector, connector_class.supports_tensor_parallel)
        return cls(
            transfer, engine_identity(vllm_config), vllm_config.cache_config.block_size,
            vllm_config.parallel_config.tensor_parallel_size,
        )  # fmt: skip


def check_parallelism(parallel: Any, connector: str, supports_tensor_parallel: bool) -> None:
    """Tensor parallelism with a connector written for it (one worker half per vLLM worker, `tp_ranks.py`);
    no pipeline parallelism. Raises TensorParallelError / PipelineParallelError saying what to change."""
    pp, tp = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    if pp != 1:
        raise PipelineParallelError(
            f"KVBridgeConnector does not run with pipeline parallelism (this engine has pipeline_parallel_size={pp}): "
            "kvbridge's connectors keep every layer of a block on one worker; use --pipeline-parallel-size 1 "
            "(tensor parallelism is supported with the NixlConnector)"
        )
    if tp != 1 and not supports_tensor_parallel:
        raise TensorParallelError(
            f"KVBridgeConnector with tensor_parallel_size={tp} runs only connectors written for tensor parallelism "
            f"(each worker moving its own KV heads: {', '.join(sorted(TP_AWARE_CONNECTORS))}); {connector!r} is not one: "
            "run it with --tensor-parallel-size 1"
        )


def engine_identity(vllm_config: Any) -> str:
    """The checkpoint's identity, plus a digest of every setting that changes the KV a prompt produces.

    Two engines share KV only when both agree; with no such setting it is `model_identity` alone, as
    kvbridge's own engine names the checkpoint (so the two engines can share).
    """
    base = model_identity(vllm_config.model_config)
    overrides = kv_overrides(vllm_config)
    if not overrides:
        return base
    try:
        encoded = msgspec.json.encode(overrides, order="sorted")
    except (TypeError, msgspec.EncodeError) as exc:
        raise ConfigError(
            f"KVBridgeConnector cannot name this engine's KV-affecting settings ({sorted(overrides)}): {exc}; "
            "give hf_overrides as plain JSON values"
        ) from exc
    return f"{base}+kv:{hashlib.sha256(encoded).hexdigest()[:32]}"


def kv_overrides(vllm_config: Any) -> dict[str, Any]:
    """Settings beside the checkpoint's files that change its KV, where they differ from the default:
    config overrides (rope scaling among them), the quantization, the KV cache dtype and its scales,
    and the revision of the model's code."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    out: dict[str, Any] = {}
    hf_overrides = getattr(model, "hf_overrides", None)
    if callable(hf_overrides):  # a function of the config: what it made is the config vLLM runs
        out["hf_config"] = json.loads(model.hf_config.to_json_string(use_diff=False))
    elif hf_overrides:
        out["hf_overrides"] = hf_overrides
    for name, default in (("quantization", None), ("code_revision", None)):
        value = getattr(model, name, default)
        if value != default:
            out[name] = value
    for name, default in (("cache_dtype", "auto"), ("calculate_kv_scales", False), ("kv_cache_dtype_skip_layers", [])):
        value = getattr(cache, name, default)
        if value != default and value is not None:
            out[name] = value
    return out


def extra_config_names(message: str) -> str:
    """`message` with the KVTransferConfig fields named as kv_connector_extra_config keys, the way a
    vLLM user sets them (`KVTransferConfig.side_channel_port=1` -> `"side_channel_port": 1`)."""
    return re.sub(r"KVTransferConfig\.(side_channel_host|side_channel_port|flush_timeout_s|extra)=?", _key, message)


def _key(match: re.Match) -> str:
    name = match.group(1)
    if name == "extra":
        return "kv_connector_extra_config"
    return f'"{name}": ' if match.group(0).endswith("=") else f'"{name}"'


def model_identity(model_config: Any) -> str:
    """The checkpoint's identity, as kvbridge's own engine names it, so both share prefix and P/D KV.

    A local checkpoint directory is identified by its content (config.json and the safetensors
    files, see `kvbridge.engine.checkpoint_id`); a hub name by the name and revision.
    """
    path = model_config.model
    config_path = os.path.join(path, "config.json")
    weights = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if os.path.isfile(config_path) and weights:
        from kvbridge.engine.checkpoint_id import checkpoint_id

        return checkpoint_id(config_path, weights)
    return f"hf:{path}@{getattr(model_config, 'revision', None) or 'main'}"
