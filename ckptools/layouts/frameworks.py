"""The frameworks whose snapshots ckptools keeps in node memory, one entry each (torch-free).

The keeper (what it writes a dead job's newest snapshot out as), a run folder's listing (`ckpt info
RUN_DIR`, `ckpt verify RUN_DIR`) and `ckptools.node.names` (the snapshots' file names) read this
table and name no framework themselves. Adding a framework is an entry here, its integration module
(which snapshots under ``prefix``) and, when its checkpoints are folders, the write-out function the
entry names (docs/development.md, "Adding a framework").

Examples:
    >>> framework_of("trainer-snapshot").name
    'the HF Trainer (CkptoolsCallback)'
    >>> framework_of("ckpt") is None  # a CheckpointManager's own prefix
    True
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ACCELERATE",
    "FRAMEWORKS",
    "LIGHTNING",
    "MANAGER_RESUMES",
    "TRAINER",
    "Framework",
    "all_frameworks",
    "framework_of",
]


# What a CheckpointManager's own newest snapshot is, newer than every checkpoint.
MANAGER_RESUMES = "is newer than every checkpoint: a restore resumes from it"


@dataclass(frozen=True)
class Framework:
    """One framework's snapshots in node memory and what they become on disk."""

    name: str  # as a listing names it: the framework and the ckptools class that snapshots it
    prefix: str  # its snapshots' file prefix in node memory (`ckptools.node.names.file_name`)
    suffix: str = ".pt"  # its snapshots' (and persisted files') suffix
    # Its own checkpoint folders in the run folder (the step in group 1), listed as its checkpoints;
    # None: its checkpoints are numbered files of `prefix`, as a CheckpointManager's.
    folders: re.Pattern[str] | None = None
    # "module:function" that writes a snapshot out as the framework's folder, ``f(snapshot, run_dir)`` -> the
    # folder written or None (a folder of that step or newer is there); imported only when used (it needs
    # torch). None: the keeper copies the snapshot file as it is.
    write_out: str | None = None
    # What a listing says of the newest snapshot when it is newer than every checkpoint: what resumes from it.
    resumes: str = MANAGER_RESUMES

    def writer(self) -> Callable[[str, str], str | None] | None:
        """The write-out function (imported now), or None when the snapshot is copied as a file."""
        if self.write_out is None:
            return None
        module, name = self.write_out.split(":")
        function: Callable[[str, str], str | None] = getattr(importlib.import_module(module), name)
        return function


TRAINER = Framework(
    "the HF Trainer (CkptoolsCallback)",
    "trainer-snapshot",
    folders=re.compile(r"^checkpoint-(\d+)$"),
    write_out="ckptools.node.trainer_folder:snapshot_to_folder",
    resumes="is newer than every checkpoint-N folder: latest_complete_checkpoint writes it out and the Trainer "
    "resumes from it",
)
# Named as Lightning names its own last checkpoints, last*.ckpt (last-snapshot-0000000123.ckpt): the only
# files Lightning's ckpt_path="last" finds beside its callbacks' own.
LIGHTNING = Framework(
    "Lightning (NodeSnapshots)",
    "last-snapshot",
    suffix=".ckpt",
    resumes="is newer than every file NodeSnapshots persisted: trainer.fit(ckpt_path='last') weighs it against the "
    "ModelCheckpoint's last.ckpt",
)
# Written out as the folder Accelerate's save_state writes, named as the snapshot's layout says (the
# script's own names: no pattern lists them).
ACCELERATE = Framework(
    "Accelerate (accelerate_snapshots.Snapshots)",
    "accelerate-snapshot",
    write_out="ckptools.node.accelerate_folder:snapshot_to_state_folder",
    resumes="is the newest: Snapshots.latest() writes it out as the folder accelerator.load_state resumes from",
)
FRAMEWORKS: tuple[Framework, ...] = (TRAINER, LIGHTNING, ACCELERATE)


def all_frameworks() -> tuple[Framework, ...]:
    """Every entry of the table, read now (a test may extend it)."""
    return FRAMEWORKS


def framework_of(prefix: str) -> Framework | None:
    """The framework whose snapshots are named ``prefix``, or None (a `CheckpointManager`'s own)."""
    return next((f for f in all_frameworks() if f.prefix == prefix), None)
