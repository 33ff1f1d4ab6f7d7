"""OffloadingConnector: host and disk tiers for KV blocks (see connector.py and docs/offload.md)."""
