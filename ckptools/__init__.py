"""ckptools: correct-by-default checkpoints for PyTorch DistributedDataParallel training.

Example:
    >>> import torch, ckptools as ck
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> manager = ck.CheckpointManager("/tmp/ckptools-doc-run", keep_last=2)
    >>> ckpt = manager.restore({"model": model, "optimizer": opt})  # None on a fresh start
    >>> path = manager.save({"model": model, "optimizer": opt}, step=1)
"""

from __future__ import annotations

from .checkpoint import load, load_state_dict, save
from .devices import resolve_map_location, to_cpu
from .dist import barrier, get_local_rank, get_rank, get_world_size, init_distributed, is_main_process
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    KeyMismatchError,
    UnsafeCheckpointError,
)
from .manager import CheckpointManager
from .sampler import ResumableDistributedSampler
from .state_dict import add_prefix, strip_prefix, unwrap_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "KeyMismatchError",
    "ResumableDistributedSampler",
    "UnsafeCheckpointError",
    "add_prefix",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "load",
    "load_state_dict",
    "resolve_map_location",
    "save",
    "strip_prefix",
    "to_cpu",
    "unwrap_model",
]
