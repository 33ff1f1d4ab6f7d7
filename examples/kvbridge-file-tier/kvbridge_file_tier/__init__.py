"""An example kvbridge connector plugin: KV blocks kept as files in a directory."""
