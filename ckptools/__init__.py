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
    CheckpointWarning,
    KeyMismatchError,
    MissingClassError,
    UnsafeCheckpointError,
    UnsafeStateError,
)

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers and IDEs
    from .background import AsyncSave, release_snapshot_buffers
    from .checkpoint import async_save, load, load_state_dict, save, save_weights
    from .convert import convert_to_safetensors, export_huggingface
    from .devices import resolve_map_location, to_cpu
    from .dist import (
        barrier,
        exit_process,
        get_local_rank,
        get_rank,
        get_world_size,
        init_distributed,
        is_main_process,
    )
    from .manager import CheckpointManager
    from .preemption import Preemption
    from .reading import CheckpointView, TensorInfo, diff, inspect, open_checkpoint, verify
    from .rewrite import rename_checkpoint
    from .sampler import ResumableDistributedSampler, SeededDataset
    from .state_dict import add_prefix, strip_prefix, unwrap_model

__version__ = "0.2.0"

_LAZY = {
    "AsyncSave": ".background",
    "CheckpointView": ".reading",
    "TensorInfo": ".reading",
    "diff": ".reading",
    "export_huggingface": ".convert",
    "inspect": ".reading",
    "open_checkpoint": ".reading",
    "verify": ".reading",
    "CheckpointManager": ".manager",
    "Preemption": ".preemption",
    "ResumableDistributedSampler": ".sampler",
    "SeededDataset": ".sampler",
    "add_prefix": ".state_dict",
    "async_save": ".checkpoint",
    "barrier": ".dist",
    "convert_to_safetensors": ".convert",
    "exit_process": ".dist",
    "get_local_rank": ".dist",
    "get_rank": ".dist",
    "get_world_size": ".dist",
    "init_distributed": ".dist",
    "is_main_process": ".dist",
    "load": ".checkpoint",
    "load_state_dict": ".checkpoint",
    "release_snapshot_buffers": ".background",
    "rename_checkpoint": ".rewrite",
    "resolve_map_location": ".devices",
    "save": ".checkpoint",
    "save_weights": ".checkpoint",
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
    "CheckpointView",
    "CheckpointWarning",
    "KeyMismatchError",
    "MissingClassError",
    "Preemption",
    "ResumableDistributedSampler",
    "SeededDataset",
    "TensorInfo",
    "UnsafeCheckpointError",
    "UnsafeStateError",
    "add_prefix",
    "async_save",
    "barrier",
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
    "release_snapshot_buffers",
    "rename_checkpoint",
    "resolve_map_location",
    "save",
    "save_weights",
    "strip_prefix",
    "to_cpu",
    "unwrap_model",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    # The public names and the module's own dunders: not the imports this file uses itself.
    return sorted(set(__all__) | {"__version__", "__all__", "__doc__", "__name__", "__file__"})
