"""Adapters that run kvbridge's connectors inside other inference engines.

Each adapter lives in its own subpackage and imports its engine only when it is imported, so
kvbridge without that engine installed is unchanged.
"""
