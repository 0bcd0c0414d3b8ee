"""Adapters for training frameworks, each imported only when used (its framework is an optional extra).

- `ckptools.integrations.lightning`: a Lightning ``CheckpointIO`` plugin, sync and async.
"""
