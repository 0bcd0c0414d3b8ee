"""The names of a manager's numbered files: one pattern for the manager, its node-memory slots, the
keeper and the integrations, and the prefix whose snapshots the keeper writes out as folders.

Imports nothing (the keeper, which imports no torch, and torch-side modules both take it).

Examples:
    >>> checkpoint_names("ckpt").fullmatch("ckpt-0000000300.pt").group(1)
    '0000000300'
"""

from __future__ import annotations

import re

__all__ = ["LIGHTNING_PREFIX", "TRAINER_FOLDER", "TRAINER_PREFIX", "checkpoint_names"]

# The HF Trainer's snapshots (ckptools.integrations.trainer_snapshots): the keeper writes them out as
# checkpoint-N/ folders rather than copying the file.
TRAINER_PREFIX = "trainer-snapshot"
# The HF Trainer's own checkpoint folders (checkpoint-123/), the step in group 1.
TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")
# Lightning's NodeSnapshots (ckptools.integrations.lightning_snapshots): last-snapshot-0000000123.pt.
LIGHTNING_PREFIX = "last-snapshot"


def checkpoint_names(prefix: str) -> re.Pattern[str]:
    """The file names `CheckpointManager` gives its checkpoints and snapshots (``ckpt-0000000300.pt``),
    the step in group 1: the one pattern the manager and the keeper both list by."""
    return re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")
