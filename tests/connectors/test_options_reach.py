"""Every option of every built-in connector reaches the connector it configures, through every way a
user sets it, or is refused with an error that names it. Nothing is dropped silently.

The ways: `kvbridge serve` flags and `--kv-connector-extra` (server.build_engine_config), an entry of
`MultiConnector`'s `extra.connectors` (set through the same flags), and the vLLM adapter's
`kv_connector_extra_config` (AdapterConfig.from_vllm, the translation the adapter runs inside vLLM).
Each case builds the connector through the factory the engine uses and reads the value back from
the built connector. Ports are checked on the running engine: the socket is bound.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvbridge

from kvbridge.cli import build_parser
from kvbridge.cli_errors import error_line
from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import ConnectorContext, KVConnectorRole
from kvbridge.connectors.factory import create_connector
from kvbridge.connectors.multi import MultiConnector
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.offload.config import OffloadConfig
from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout
from kvbridge.serve import server



def _adapter_config_module():
    """kvbridge/integrations/vllm/config.py, the adapter's translation of vLLM's config. Loaded by path:
    the package's __init__ imports vLLM, the module itself does not."""
    path = Path(kvbridge.__file__).parent / "integrations" / "vllm" / "config.py"
    spec = importlib.util.spec_from_file_location("kvbridge_vllm_adapter_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


AdapterConfig = _adapter_config_module().AdapterConfig

# A value other than the default for every option; a new option without one fails the coverage test.
NIXL_VALUES = {
    "handshake_timeout_s": 3.5, "handshake_retries": 4, "transfer_timeout_s": 12.0, "backend": "UCX",
    "backend_params": {"num_workers": "2"}, "descriptor_mode": "ranges", "max_descriptor_nbytes": 1 << 20,
    "cuda_ipc": False, "ipc_min_runs": 3, "lease_s": 7.0, "allowed_peers": ["10.0.0.0/8"], "max_peers": 5,
    "peer_idle_s": 9.0, "verify_kv_digest": False, "insecure_side_channel": True, "digest_kv_heads": False,
    "wait_ipc_reads": False, "sign_grants": False, "unreachable_peer_cooldown_s": 0.0, "sync_ipc_reads": True,
    "handoff_inbox": True, "handoff_inbox_port": 45678, "handoff_wait_s": 5.0, "idle_step_wait_s": 0.0,
    "ipc_sm_reads": False,
}  # fmt: skip
OFFLOAD_VALUES = {
    "host_num_blocks": 33, "host_capacity_bytes": 1 << 22, "eviction_policy": "arc", "disk_dir": "/nonexistent/kv",
    "disk_num_blocks": 44, "disk_capacity_bytes": 1 << 24, "staging_blocks": 8, "pin_memory": False,
    "copy_threads": 1, "debug_store_delay_s": 0.01, "debug_load_delay_s": 0.02, "verify_kv_digest": False,
}  # fmt: skip
OPTIONS = {"NixlConnector": (NixlOptions, NIXL_VALUES), "OffloadingConnector": (OffloadConfig, OFFLOAD_VALUES)}
CASES = [(name, key) for name, (_, values) in OPTIONS.items() for key in values]
LAYOUT = KVCacheLayout(num_blocks=8, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")


def context() -> ConnectorContext:
    return ConnectorContext(model_id="m", block_size=16, device="cpu", layout=LAYOUT)


def expected(key: str, value):
    """The value as the options dataclass holds it once validated."""
    return {"descriptor_mode": lambda v: v, "allowed_peers": tuple}.get(key, lambda v: v)(value)


def option_of(connector, key: str):
    """What the built connector runs with for option `key`."""
    options = getattr(connector, "options", None) or connector.offload_config
    value = getattr(options, key)
    return value.value if hasattr(value, "value") else value  # an Enum: its wire value


def serve_config(*flags: str) -> KVTransferConfig:
    args = build_parser().parse_args(["serve", "--num-blocks", "8", *flags])
    return server.build_engine_config(args).kv_transfer


def vllm_config(extra: dict, kv_role: str = "kv_both") -> SimpleNamespace:
    """What AdapterConfig.from_vllm reads of vLLM's config, with `extra` as kv_connector_extra_config."""
    kv = SimpleNamespace(kv_connector_extra_config=extra, kv_role=kv_role, engine_id="e-vllm", kv_load_failure_policy="fail")
    return SimpleNamespace(
        kv_transfer_config=kv, parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="/nonexistent/model", revision=None), cache_config=SimpleNamespace(block_size=16),
    )  # fmt: skip


def built(config: KVTransferConfig, role: KVConnectorRole = KVConnectorRole.SCHEDULER):
    """The connector the engine would build from `config`, and its child when it is a MultiConnector."""
    connector = create_connector(config, role, context())
    return connector.children[0] if isinstance(connector, MultiConnector) else connector


def test_every_option_of_every_builtin_connector_has_a_case():
    for name, (cls, values) in OPTIONS.items():
        assert {f.name for f in dataclasses.fields(cls)} == set(values), name


@pytest.mark.parametrize(("connector", "key"), CASES)
def test_an_option_in_kv_connector_extra_reaches_the_connector(connector, key):
    value = OPTIONS[connector][1][key]
    config = serve_config("--kv-connector", connector, "--kv-connector-extra", json.dumps({key: value}))
    assert option_of(built(config), key) == expected(key, value)


@pytest.mark.parametrize(("connector", "key"), CASES)
def test_an_option_of_a_multiconnector_child_reaches_the_child(connector, key):
    value = OPTIONS[connector][1][key]
    extra = {"connectors": [{"connector": connector, "extra": {key: value}}]}
    config = serve_config("--kv-connector", "MultiConnector", "--kv-connector-extra", json.dumps(extra))
    assert option_of(built(config), key) == expected(key, value)


@pytest.mark.parametrize(("connector", "key"), CASES)
def test_an_option_in_vllm_kv_connector_extra_config_reaches_the_connector(connector, key):
    value = OPTIONS[connector][1][key]
    setup = AdapterConfig.from_vllm(vllm_config({"connector": connector, key: value}))
    assert option_of(built(setup.transfer), key) == expected(key, value)


@pytest.mark.parametrize("connector", list(OPTIONS))
def test_an_unknown_option_is_refused_on_every_path_naming_it(connector):
    bad = {"no_such_option": 1}
    with pytest.raises(ConfigError, match="no_such_option") as exc:
        built(serve_config("--kv-connector", connector, "--kv-connector-extra", json.dumps(bad)))
    assert "--kv-connector-extra" in error_line("serve", exc.value)
    multi = {"connectors": [{"connector": connector, "extra": bad}]}
    with pytest.raises(ConfigError, match=r"extra\.connectors\[0\].*no_such_option"):
        built(serve_config("--kv-connector", "MultiConnector", "--kv-connector-extra", json.dumps(multi)))
    with pytest.raises(ConfigError, match="kv_connector_extra_config.*no_such_option"):
        AdapterConfig.from_vllm(vllm_config({"connector": connector, **bad}))


# ---------------------------------------------------------------------- KVTransferConfig fields

FIELD_FLAGS = [  # (field, flag, value as typed, value in the config)
    ("engine_id", "--engine-id", "node-7", "node-7"),
    ("side_channel_host", "--side-channel-host", "127.0.0.2", "127.0.0.2"),
    ("flush_timeout_s", "--flush-timeout", "4.5", 4.5),
    ("load_failure_policy", "--load-failure-policy", "fail", "fail"),
]


@pytest.mark.parametrize(("field", "flag", "typed", "value"), FIELD_FLAGS)
@pytest.mark.parametrize("connector", ["NixlConnector", "OffloadingConnector", "MultiConnector"])
def test_a_connector_flag_reaches_the_connector_and_every_child(connector, field, flag, typed, value):
    flags = ["--kv-connector", connector, flag, typed]
    if connector == "MultiConnector":
        children = [{"connector": "NixlConnector"}, {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 8}}]
        flags += ["--kv-connector-extra", json.dumps({"connectors": children})]
    connector_ = create_connector(serve_config(*flags), KVConnectorRole.SCHEDULER, context())
    for each in getattr(connector_, "children", [connector_]):
        assert getattr(each.config, field) == value, each


@pytest.mark.parametrize("field", ["side_channel_host", "side_channel_port", "flush_timeout_s"])
def test_a_config_field_in_vllm_kv_connector_extra_config_reaches_the_connector(field):
    value = {"side_channel_host": "127.0.0.2", "side_channel_port": 5601, "flush_timeout_s": 4.5}[field]
    for extra in ({"connector": "NixlConnector"},
                  {"connector": "MultiConnector", "connectors": [{"connector": "NixlConnector"}]}):  # fmt: skip
        setup = AdapterConfig.from_vllm(vllm_config({**extra, field: value}))
        assert getattr(built(setup.transfer).config, field) == value


def _is_bound(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.nixl
@pytest.mark.parametrize("path", ["flag", "multi flag", "multi entry", "vllm", "vllm multi"])
def test_the_side_channel_port_is_bound_on_every_path(path):
    port = _free_port()
    multi = {"connectors": [{"connector": "NixlConnector"}, {"connector": "OffloadingConnector", "extra": {"host_num_blocks": 8}}]}
    match path:
        case "flag":
            config = serve_config("--role", "prefill", "--side-channel-port", str(port))
        case "multi flag":
            config = serve_config("--role", "prefill", "--side-channel-port", str(port), "--kv-connector", "MultiConnector",
                                  "--kv-connector-extra", json.dumps(multi))  # fmt: skip
        case "multi entry":
            entries = [{**multi["connectors"][0], "side_channel_port": port}, multi["connectors"][1]]
            config = serve_config("--role", "prefill", "--kv-connector", "MultiConnector",
                                  "--kv-connector-extra", json.dumps({"connectors": entries}))  # fmt: skip
        case "vllm":
            config = AdapterConfig.from_vllm(vllm_config({"connector": "NixlConnector", "side_channel_port": port})).transfer
        case "vllm multi":
            extra = {"connector": "MultiConnector", "side_channel_port": port, **multi}
            config = AdapterConfig.from_vllm(vllm_config(extra, kv_role="kv_producer")).transfer
    from kvbridge.engine.core import EngineCore
    from kvbridge.config import CacheConfig, EngineConfig

    assert not _is_bound(port)
    engine = EngineCore(EngineConfig(cache=CacheConfig(num_blocks=8), kv_transfer=config))
    try:
        assert _is_bound(port), f"{path}: nothing listens on side_channel_port {port}"
    finally:
        engine.shutdown()
    assert not _is_bound(port)


REFUSED = [  # flags -> what the error names
    (["--role", "decode", "--side-channel-port", "5601"], "--side-channel-port 5601"),
    (["--kv-connector", "OffloadingConnector", "--side-channel-port", "5601"], "--side-channel-port 5601"),
    (["--role", "decode", "--side-channel-port", "5601", "--kv-connector", "MultiConnector", "--kv-connector-extra",
      json.dumps({"connectors": [{"connector": "NixlConnector"}]})], "--side-channel-port 5601"),
    (["--role", "prefill", "--side-channel-port", "5601", "--kv-connector", "MultiConnector", "--kv-connector-extra",
      json.dumps({"connectors": [{"connector": "NixlConnector"}, {"connector": "NixlConnector"}]})], "cannot share one port"),
    (["--kv-connector", "MultiConnector", "--kv-connector-extra",
      json.dumps({"connectors": [{"connector": "OffloadingConnector", "side_channel_port": 5601}]})],
     r"extra.connectors[0].side_channel_port=5601"),
    (["--kv-connector", "MultiConnector", "--kv-connector-extra",
      json.dumps({"connectors": [{"connector": "NixlConnector", "load_failure_policy": "fail"}]})],
     "extra.connectors[0].load_failure_policy='fail'"),
    (["--kv-connector", "MultiConnector", "--kv-connector-extra", json.dumps({"connectors": [], "lease_s": 3})], "lease_s"),
    (["--no-connector", "--side-channel-port", "5601"], "--side-channel-port"),
    (["--no-connector", "--kv-connector-extra", "{}"], "--kv-connector-extra"),
    (["--no-connector", "--load-failure-policy", "fail"], "--load-failure-policy"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "named"), REFUSED)
def test_an_option_a_path_cannot_honour_is_refused_naming_it(flags, named):
    with pytest.raises(ConfigError) as exc:
        config = serve_config(*flags)
        create_connector(config, KVConnectorRole.SCHEDULER, context())
    assert named in error_line("serve", exc.value)


def test_vllm_side_channel_port_for_a_consumer_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match='"side_channel_port": 5601') as exc:
        AdapterConfig.from_vllm(vllm_config({"connector": "NixlConnector", "side_channel_port": 5601}, kv_role="kv_consumer"))
    assert "kv_connector_extra_config" in str(exc.value)


def test_a_port_given_twice_to_a_multiconnector_is_refused():
    entries = [{"connector": "NixlConnector", "side_channel_port": 5602}, {"connector": "OffloadingConnector"}]
    with pytest.raises(ConfigError) as exc:
        built(serve_config("--role", "prefill", "--side-channel-port", "5601", "--kv-connector", "MultiConnector",
                           "--kv-connector-extra", json.dumps({"connectors": entries})))  # fmt: skip
    assert "--side-channel-port 5601 would not be used" in error_line("serve", exc.value)
