"""Adapters for training frameworks, each imported only when used (its framework is an optional extra).

- `ckptools.integrations.lightning`: a Lightning ``CheckpointIO`` plugin, sync and async.
- `ckptools.integrations.transformers`: a ``TrainerCallback`` sealing each ``checkpoint-N/`` with a
  manifest, and `latest_complete_checkpoint` for ``trainer.train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import re

__all__ = ["installed", "release_numbers"]


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
