"""kvbridge's connectors inside vLLM: `KVBridgeConnector`, a V1 KV connector for vLLM 0.25 (CUDA) and 0.32 (CPU).

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_producer|kv_consumer|kv_both",
                           "kv_connector_extra_config": {"connector": "NixlConnector", ...}}'

Importing this package imports vLLM; the rest of kvbridge never does. See docs/vllm.md.
"""

from kvbridge.integrations.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
