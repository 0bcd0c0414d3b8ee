"""Adapters for training frameworks, each imported only when used (its framework is an optional extra).

- `ckptools.integrations.lightning`: a Lightning ``CheckpointIO`` plugin, sync and async.
- `ckptools.integrations.transformers`: a ``TrainerCallback`` sealing each ``checkpoint-N/`` with a
  manifest, and `latest_complete_checkpoint` for ``trainer.train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from ..layouts import LIGHTNING

LIGHTNING_PREFIX = LIGHTNING.prefix  # NodeSnapshots' files: the keeper persists them under Lightning's names

__all__ = ["LIGHTNING_PREFIX", "NEEDS_LIGHTNING", "installed", "lightning_classes", "release_numbers", "replicated"]


NEEDS_LIGHTNING = "ckptools.integrations.lightning needs Lightning: pip install pytorch-lightning (or lightning)"


def lightning_classes(name: str, *modules: str) -> list[Any]:
    """The class ``name`` of each of ``modules`` that imports: one per Lightning installed (the
    standalone packages, the unified ``lightning``), the first the base of ckptools' own.

    Examples:
        >>> lightning_classes("Callback", "no_such_lightning.callbacks")
        []
    """
    found = []
    for module in modules:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    return found


def replicated(distributed_type: Any) -> bool:
    """Whether Accelerate's ``distributed_type`` keeps a whole replica of the model in every process:
    DDP's ``MULTI_GPU``, ``MULTI_CPU``, ``MULTI_XPU``, ..., not FSDP's or DeepSpeed's shards.

    Examples:
        >>> replicated("MULTI_CPU"), replicated("FSDP"), replicated(None)
        (True, False, False)
    """
    return str(getattr(distributed_type, "value", distributed_type)).startswith("MULTI_")


def release_numbers(version: str) -> tuple[int, ...]:
    """The first two numbers of a release's version (major, minor), to compare with a bound.

    Examples:
        >>> release_numbers("2.5.0.post0"), release_numbers("5.0.0rc1") < (5, 0)
        ((2, 5), False)
    """
    return tuple(int(n) for n in re.findall(r"\d+", version)[:2])


def installed(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (``"pytorch-lightning"``), or None."""
    from importlib.metadata import PackageNotFoundError, version  # at the call: a test may stand in for it

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
