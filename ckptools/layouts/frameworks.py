"""The frameworks whose snapshots ckptools keeps in node memory, one entry each, and how a folder one
of them wrote is told by its names (torch-free).

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
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..errors import CheckpointFormatError

__all__ = [
    "ACCELERATE",
    "ACCELERATE_GRADIENTS",
    "ACCELERATE_RNG",
    "ACCELERATE_STATE",
    "FRAMEWORKS",
    "LIGHTNING",
    "MANAGER_RESUMES",
    "TRAINER",
    "TRAINER_FOLDERS",
    "TRAINER_STATE",
    "AccelerateLayout",
    "Framework",
    "accelerate_file",
    "accelerate_pattern",
    "all_frameworks",
    "framework_of",
    "is_accelerate_folder",
    "is_trainer_folder",
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


TRAINER_FOLDERS = re.compile(r"^checkpoint-(\d+)$")  # the HF Trainer's checkpoint-N/ folders, the step in group 1
TRAINER = Framework(
    "the HF Trainer (CkptoolsCallback)",
    "trainer-snapshot",
    folders=TRAINER_FOLDERS,
    write_out="ckptools.node.write_outs:snapshot_to_folder",
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
    write_out="ckptools.node.write_outs:snapshot_to_state_folder",
    resumes="is the newest: Snapshots.latest() writes it out as the folder accelerator.load_state resumes from",
)
FRAMEWORKS: tuple[Framework, ...] = (TRAINER, LIGHTNING, ACCELERATE)


# What Accelerator.save_state names its files (accelerate/utils/constants.py: SAFE_WEIGHTS_NAME, WEIGHTS_NAME,
# OPTIMIZER_NAME, SCHEDULER_NAME, SAMPLER_NAME, RNG_STATE_NAME; custom_checkpoint_<i>.pkl), the one place
# ckptools spells them: the i-th object's file is numbered (optimizer.bin, optimizer_1.bin), ``{rank}`` a process's.
_ACCELERATE_FILES = {
    "model": "model.safetensors",
    "bare_model": "pytorch_model.bin",
    "optimizer": "optimizer.bin",
    "scheduler": "scheduler.bin",
    "sampler": "sampler.bin",
    "dl_state_dict": "dl_state_dict.bin",
    "scaler": "scaler.pt",
    "custom": "custom_checkpoint_{i}.pkl",
    "random_states": "random_states_{rank}.pkl",
}
ACCELERATE_GRADIENTS = "ckptools-gradients-{rank}.pt"  # a process's open accumulation window, ckptools' own file


def accelerate_file(kind: str, i: int = 0, *, rank: int = 0) -> str:
    """The name Accelerate's ``save_state`` gives the ``i``-th object of ``kind`` (a key of the table above).

    Examples:
        >>> accelerate_file("optimizer"), accelerate_file("model", 1), accelerate_file("random_states", rank=3)
        ('optimizer.bin', 'model_1.safetensors', 'random_states_3.pkl')
    """
    base = _ACCELERATE_FILES[kind]
    if "{" in base:
        return base.format(i=i, rank=rank)
    return base if i == 0 else base.replace(".", f"_{i}.", 1)


def accelerate_pattern(*kinds: str) -> re.Pattern[str]:
    """The names Accelerate gives files of ``kinds``, any number or process (the number in group 1 for one
    kind with ``{i}``/``{rank}``).

    Examples:
        >>> bool(accelerate_pattern("optimizer", "scheduler").match("scheduler_2.bin"))
        True
        >>> accelerate_pattern("random_states").match("random_states_3.pkl").group(1)
        '3'
    """
    alternatives = []
    for kind in kinds:
        base = _ACCELERATE_FILES[kind]
        if "{" in base:
            alternatives.append(re.escape(base).replace(r"\{i\}", r"(\d+)").replace(r"\{rank\}", r"(\d+)"))
        else:
            stem, suffix = base.split(".", 1)
            alternatives.append(re.escape(stem) + r"(?:_\d+)?\." + re.escape(suffix))
    return re.compile("^(?:" + "|".join(alternatives) + ")$")


# What Accelerator.save_state writes beside the model, by name.
ACCELERATE_RNG = accelerate_pattern("random_states")
ACCELERATE_STATE = accelerate_pattern("optimizer", "scheduler", "sampler", "dl_state_dict")


TRAINER_STATE = "trainer_state.json"  # the Trainer's last file of a checkpoint-N/ folder
# Names only the Trainer writes (optimizer.pt and scheduler.pt are too common to tell anything).
_TRAINER_FILES = re.compile(r"^(training_args\.bin|rng_state(_\d+)?\.pth)$")


def is_trainer_folder(folder: str, names: Collection[str]) -> bool:
    """Whether ``folder`` was written by the HF Trainer's ``_save_checkpoint`` (by its name or its files)."""
    if TRAINER_FOLDERS.match(os.path.basename(folder.rstrip("/"))):
        return True
    return any(_TRAINER_FILES.match(n) for n in names) or TRAINER_STATE in names


def is_accelerate_folder(names: Collection[str]) -> bool:
    """Whether a folder holding ``names`` was written by Accelerate's ``save_state`` (by its files).

    Examples:
        >>> is_accelerate_folder(["model.safetensors", "random_states_0.pkl"])
        True
        >>> is_accelerate_folder(["model.safetensors"])
        False
    """
    return any(ACCELERATE_RNG.match(n) or ACCELERATE_STATE.match(n) for n in names)


@dataclass(frozen=True)
class AccelerateLayout:
    """What an Accelerate snapshot holds and the folder it becomes: `Snapshots` writes it into the snapshot's
    metadata, the write-out (`ckptools.node.write_outs`) reads it back; `entry` names the snapshot's entries.

    Examples:
        >>> layout = AccelerateLayout(models=1, optimizers=1)
        >>> AccelerateLayout.from_metadata(layout.to_metadata(), "s.pt") == layout, AccelerateLayout.entry("model", 0)
        (True, 'model_0')
    """

    name: str = "step_{step}"  # the folder's name, {step} its step (the script's own naming)
    models: int = 0
    optimizers: int = 0
    schedulers: int = 0
    customs: int = 0  # the objects registered for checkpointing
    safe_serialization: bool = True  # model.safetensors, else pytorch_model.bin

    ENTRY: ClassVar[str] = "ckptools.accelerate"  # the snapshot's metadata entry that holds it

    @staticmethod
    def entry(kind: str, i: int) -> str:
        """The snapshot's entry of the ``i``-th ``kind`` (``model``, ``optimizer``, ``scheduler``, ``custom``)."""
        return f"{kind}_{i}"

    def to_metadata(self) -> dict[str, dict[str, Any]]:
        """The metadata a snapshot carries it as (plain types: torch's weights-only reader takes them)."""
        return {self.ENTRY: {f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], where: str) -> AccelerateLayout:
        """The layout a snapshot's metadata holds; `CheckpointFormatError` naming ``where`` when it holds none."""
        found = metadata.get(cls.ENTRY)
        layout = None
        if isinstance(found, dict) and set(found) <= {f.name for f in fields(cls)}:
            layout = cls(**found)
        typed = layout is not None and all(isinstance(getattr(layout, f.name), type(f.default)) for f in fields(cls))
        if layout is None or not typed or "{step}" not in layout.name:
            raise CheckpointFormatError(
                f"{where} holds no Accelerate layout ({cls.ENTRY!r} in its metadata): not a snapshot of "
                "ckptools.integrations.accelerate_snapshots.Snapshots"
            )
        return layout


def all_frameworks() -> tuple[Framework, ...]:
    """Every entry of the table, read now (a test may extend it)."""
    return FRAMEWORKS


def framework_of(prefix: str) -> Framework | None:
    """The framework whose snapshots are named ``prefix``, or None (a `CheckpointManager`'s own)."""
    return next((f for f in all_frameworks() if f.prefix == prefix), None)
