"""ckptools: correct-by-default checkpoints for PyTorch DistributedDataParallel training.

Names are imported on first use (PEP 562), so ``import ckptools`` and the ``ckpt`` CLI's
``--help`` do not pay for importing torch; ``ck.save`` and friends import it when touched.

Examples:
    >>> import torch, ckptools as ck
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> manager = ck.CheckpointManager("/tmp/ckptools-doc-run", keep_last=2)
    >>> ckpt = manager.restore({"model": model, "optimizer": opt})  # None on a fresh start
    >>> path = manager.save({"model": model, "optimizer": opt}, step=1)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointLayoutError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CheckpointWarning,
    KeyMismatchError,
    MissingClassError,
    NodeMemoryError,
    NotChecksummedError,
    ReplicaMismatchError,
    StorageStalledError,
    UnsafeCheckpointError,
    UnsafeStateError,
)

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers and IDEs
    from .collective.arrival import barrier
    from .collective.group import get_local_rank, get_rank, get_world_size, is_main_process
    from .converting import convert, convert_to_safetensors, export_huggingface, rename_checkpoint
    from .devices import resolve_map_location, to_cpu
    from .inspection import diff, inspect, verify, verify_report
    from .layouts import open_checkpoint
    from .manager import CheckpointManager
    from .per_rank import PerRank
    from .read import load, load_state_dict
    from .saving import async_save, check_replicas, save, save_weights
    from .state_dict import add_prefix, strip_prefix, unwrap_model
    from .training.loader import ResumableDataLoader
    from .training.preemption import Preemption
    from .training.process import exit_process, init_distributed
    from .training.sampler import ResumableDistributedSampler
    from .training.seeded import SeededDataset
    from .view import CheckpointView, TensorInfo, Verification
    from .write import AsyncSave, release_staging_buffers

from ._version import __version__ as __version__

_LAZY = {
    "AsyncSave": ".write",
    "CheckpointView": ".view",
    "TensorInfo": ".view",
    "Verification": ".view",
    "diff": ".inspection",
    "export_huggingface": ".converting",
    "inspect": ".inspection",
    "open_checkpoint": ".layouts",
    "verify": ".inspection",
    "verify_report": ".inspection",
    "CheckpointManager": ".manager",
    "PerRank": ".per_rank",
    "Preemption": ".training.preemption",
    "ResumableDataLoader": ".training.loader",
    "ResumableDistributedSampler": ".training.sampler",
    "SeededDataset": ".training.seeded",
    "add_prefix": ".state_dict",
    "async_save": ".saving",
    "barrier": ".collective.arrival",
    "convert": ".converting",
    "convert_to_safetensors": ".converting",
    "exit_process": ".training.process",
    "get_local_rank": ".collective.group",
    "get_rank": ".collective.group",
    "get_world_size": ".collective.group",
    "init_distributed": ".training.process",
    "is_main_process": ".collective.group",
    "load": ".read",
    "load_state_dict": ".read",
    "release_staging_buffers": ".write",
    "rename_checkpoint": ".converting",
    "resolve_map_location": ".devices",
    "save": ".saving",
    "check_replicas": ".saving",
    "save_weights": ".saving",
    "strip_prefix": ".state_dict",
    "to_cpu": ".devices",
    "unwrap_model": ".state_dict",
}

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointLayoutError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CheckpointView",
    "CheckpointWarning",
    "KeyMismatchError",
    "MissingClassError",
    "NodeMemoryError",
    "NotChecksummedError",
    "PerRank",
    "Preemption",
    "ReplicaMismatchError",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "SeededDataset",
    "StorageStalledError",
    "TensorInfo",
    "UnsafeCheckpointError",
    "UnsafeStateError",
    "Verification",
    "add_prefix",
    "async_save",
    "barrier",
    "check_replicas",
    "convert",
    "convert_to_safetensors",
    "diff",
    "exit_process",
    "export_huggingface",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "inspect",
    "is_main_process",
    "load",
    "load_state_dict",
    "open_checkpoint",
    "release_staging_buffers",
    "rename_checkpoint",
    "resolve_map_location",
    "save",
    "save_weights",
    "strip_prefix",
    "to_cpu",
    "unwrap_model",
    "verify",
    "verify_report",
]


# Old spellings kept for one release (0.4): each warns once where it is used and gives the new name.
_DEPRECATED = {"release_snapshot_buffers": "release_staging_buffers"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        import warnings

        new = _DEPRECATED[name]
        warnings.warn(f"ckptools.{name} is deprecated and goes in 0.5: use ckptools.{new} (the same function; an "
                      "async save's host copy is its staging, a snapshot is what CheckpointManager.snapshot keeps)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return __getattr__(new)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    # The public names and the module's own dunders: not the imports this file uses itself.
    return sorted(set(__all__) | {"__version__", "__all__", "__doc__", "__name__", "__file__"})
