"""The Hugging Face ``Trainer``: checkpoint folders a resume can trust.

    >>> from ckptools.integrations.transformers import CkptoolsCallback, latest_complete_checkpoint  # doctest: +SKIP
    >>> trainer = Trainer(..., callbacks=[CkptoolsCallback()])  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=latest_complete_checkpoint(args.output_dir))  # doctest: +SKIP

The ``Trainer`` writes ``checkpoint-N/`` file by file, in place (``_save_checkpoint``: model,
optimizer, scheduler, scaler, RNG states, ``trainer_state.json``, then it removes the oldest
folders beyond ``save_total_limit``), and ``resume_from_checkpoint=True`` takes the folder with
the highest N (``get_last_checkpoint``), whole or not: a kill mid-save leaves a folder without its
optimizer or trainer state, and the resume fails on it, or silently restarts parts of the state.

What the Trainer's extension points allow (read in transformers 5.x; ``on_save`` runs right after
``_save_checkpoint``): `CkptoolsCallback` writes ``ckptools-manifest.json`` into each new
``checkpoint-N/`` last, atomically, on the process that saves: every file's size and CRC-32.
`latest_complete_checkpoint` returns the newest folder that is complete: its manifest matches
(sizes; CRC-32s with ``verify=True``), or, for a folder without one (saved without the
callback, or killed between the Trainer's last file and the manifest), its
``trainer_state.json`` reads and every file in it checks out by its kind
(`ckptools.layouts.folder_check`, which ``ckpt verify`` uses too). A folder it skips is named in a
`ckptools.CheckpointWarning`, with why.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .. import log
from ..collective.group import get_world_size
from ..layouts import MANIFEST, check_folder, write_manifest
from ..manager import CheckpointManager
from ..owned.gradients import track
from ..training.seeded import SeededDataset
from ..write import compare_now, replicas_switch
from . import installed, release_numbers, replicated, trainer_snapshots
from ._memory_folders import FolderKind, from_node_memory, newest_snapshot  # noqa: F401 - re-exported: tests and users import it here
from .trainer_snapshots import CHECKPOINT_FOLDER, snapshot_to_folder

try:
    from transformers import TrainerCallback
except ImportError as err:
    raise ImportError("ckptools.integrations.transformers needs transformers: pip install transformers") from err

__all__ = ["MANIFEST", "CkptoolsCallback", "latest_complete_checkpoint", "snapshot_to_folder", "write_manifest"]

# The Trainer's snapshots, written out as its checkpoint-N/ folders on a relaunch.
_TRAINER_FOLDERS = FolderKind(
    trainer_snapshots.PREFIX, "checkpoint-{}".format, snapshot_to_folder, "latest_complete_checkpoint"
)

# The oldest releases whose Trainer resumes mid-epoch bit-identically (tests/test_transformers.py,
# `make compat`): with accelerate 1.6 the skipped batches of the resumed epoch come from another
# epoch's order (its SkipDataLoader does not pass the epoch to the sampler; 1.7 does); with
# transformers 4.57.6 (and 4.50, 4.53, 4.55) the resumed run ends with other weights, also without
# augmentation. Older releases still get complete folders; the resume is then not exact, and
# `CkptoolsCallback` says so once.
EXACT_FROM = {"transformers": (5, 0), "accelerate": (1, 7)}


def _inexact_releases() -> list[str]:
    """The installed releases of `EXACT_FROM` older than the oldest measured exact, as 'name version'."""
    old = []
    for name, oldest in EXACT_FROM.items():
        found = installed(name)
        if found is None:
            continue
        numbers = release_numbers(found)
        if len(numbers) == 2 and numbers < oldest:
            old.append(f"{name} {found} (exact from {'.'.join(map(str, oldest))})")
    return old


class CkptoolsCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """A ``TrainerCallback`` that seals every ``checkpoint-N/`` the Trainer saves with a manifest,
    and keeps a `ckptools.SeededDataset` train dataset's epoch.

    The manifest: on the process that saves (``args.should_save``), in ``on_save``, i.e. after the
    Trainer wrote the folder's last file. Costs one read of the folder (its CRC-32s).

    The epoch: the Trainer's own resume restores the random streams and the shuffled order, but
    not random augmentation in ``__getitem__`` (workers start their streams afresh, and the streams
    are put back only after the resumed epoch's first batch was fetched). Wrapped as
    ``ck.SeededDataset(dataset, seed=args.seed)``, each item's draws depend on (seed, epoch,
    index) alone; this callback gives it the epoch as each one begins (``on_epoch_begin``, before
    the Trainer starts that epoch's workers). It refuses ``dataloader_persistent_workers=True``
    then: persistent workers keep the epoch they started with.

    ``snapshot_every=n``: a node-memory snapshot every n-th step (the
    newest resumed from by `latest_complete_checkpoint`); ``budget``: the fraction of the loop's time
    they may stall it, as `ckptools.CheckpointManager.snapshot`'s (the default None: every n-th step).

    Under DDP, before each save and snapshot, the ranks' replicas of the model and the optimizer are
    compared (``replicas=``: ``"auto"``, the default, every byte before a save and a rotating 1/50 before a
    snapshot; ``"all"`` every byte, ``"sample"`` the 1/50, ``"off"`` none, before both;
    ``check_replicas=False``, the old ``"off"``, warns and goes in 0.6): when one
    rank's copy changed alone, `ReplicaMismatchError` on every rank and nothing written.

    Examples:
        >>> from ckptools.integrations.transformers import CkptoolsCallback  # doctest: +SKIP
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptoolsCallback()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        snapshot_every: int | None = None,
        budget: float | None = None,
        replicas: str = "auto",
        check_replicas: bool | None = None,
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        if snapshot_every is not None and snapshot_every < 1:
            raise ValueError(f"snapshot_every must be at least 1 (or None: no snapshots), got {snapshot_every}")
        self.snapshot_every = snapshot_every
        self.budget = budget
        self.replicas = replicas_switch(replicas, "CkptoolsCallback", check_replicas=check_replicas)
        self._manager: CheckpointManager | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        old = _inexact_releases()
        if old:
            log.warn(
                f"the Trainer resumes mid-epoch with other weights than a run never stopped with {', '.join(old)}: "
                "checkpoint folders are still sealed and checked, but for exact resumes upgrade",
                once="hf_inexact_release",
            )
        persistent = getattr(args, "dataloader_persistent_workers", False)
        if persistent and _seeded(kwargs.get("train_dataloader")) is not None:
            raise ValueError(
                "the train dataset is a ck.SeededDataset without a sampler, whose epoch DataLoader workers copy when "
                "they start: with dataloader_persistent_workers=True they would keep the first one; leave it False"
            )
        return control

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        seeded = _seeded(kwargs.get("train_dataloader"))
        if seeded is not None:
            # state.epoch is epoch + (step / steps in the epoch): restored mid-epoch, that epoch.
            seeded.set_epoch(math.floor(float(state.epoch or 0) + 1e-9))
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        every = self.snapshot_every
        if every is None or state.global_step % every:
            return self._before_a_save(control, kwargs)
        if self._manager is None:
            self._manager = CheckpointManager(args.output_dir, prefix=trainer_snapshots.PREFIX)
        taken = trainer_snapshots.capture(
            args, state, control, kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"]
        )
        compare = _ddp_replicas(kwargs) if self.replicas != "off" else None
        if self._manager.snapshot(taken, state.global_step, budget=self.budget, replicas=self.replicas,
                                  compare=compare) is None:  # fmt: skip
            return self._before_a_save(control, kwargs)  # skipped: nothing was compared
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._before_a_save(control, kwargs)

    def _before_a_save(self, control: Any, kwargs: dict[str, Any]) -> Any:
        """Every rank, when the Trainer saves next (``control.should_save``, set by its flow callback, which
        runs first): DDP's replicas compared before ``_save_checkpoint`` writes anything."""
        replicas = _ddp_replicas(kwargs) if self.replicas != "off" and control.should_save else None
        if replicas:  # a durable save: every byte, unless told "sample"
            compare_now(replicas, sample=self.replicas == "sample", declared=True)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """The training ended (every rank): the snapshot being committed is finished; the newest stays
        in node memory until the job ends (`ckptools.exit_process`) or, the job gone, the keeper writes it
        out as a ``checkpoint-N/`` folder when that is newer than every folder."""
        if self._manager is not None:
            self._manager.close()
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if getattr(args, "should_save", True):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                write_manifest(folder)
        return control


def _ddp_replicas(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model and optimizer every rank holds alike when the Trainer runs DDP (its callbacks see the
    module DDP wraps, so it is declared a replica); empty under FSDP, DeepSpeed or one process."""
    model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
    if get_world_size() < 2 or model is None or optimizer is None:
        return {}
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return {}
    if not replicated(AcceleratorState._shared_state.get("distributed_type")):  # the Trainer's accelerator's
        return {}
    if getattr(model, "is_parallelizable", False) and getattr(model, "model_parallel", False):
        return {}  # split over devices, not replicated
    return {"model": model, "optimizer": optimizer}


def _seeded(loader: Any) -> SeededDataset[Any] | None:
    """The loader's dataset if it is a `SeededDataset` that takes its epoch from `set_epoch`."""
    dataset = getattr(loader, "dataset", None)
    return dataset if isinstance(dataset, SeededDataset) and dataset.sampler is None else None


def latest_complete_checkpoint(output_dir: str, *, verify: bool = True) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that is complete, or None.

    Complete: its manifest (`CkptoolsCallback`) lists every file with the size it has (and, with
    ``verify``, the CRC-32); without a manifest, its ``trainer_state.json`` reads; and, with
    ``verify``, every other file passes the check of its kind (torch files their CRC-32s,
    safetensors files their structure, JSON files a parse). The judgement is
    `ckptools.layouts.folder_check.check_folder`, the one ``ckpt verify FOLDER`` makes too.
    Folders that are not are skipped with a `ckptools.CheckpointWarning` saying why.

    With ``CkptoolsCallback(snapshot_every=...)``, a snapshot in node memory newer than every folder
    is written out first as ``checkpoint-N/`` and returned: a relaunch after kill -9 resumes at most one
    step behind. Collective where a process group exists (call it once the Trainer is made): every
    rank returns the same folder, and a node without the chosen snapshot receives it first.

    Examples:
        >>> from ckptools.integrations.transformers import latest_complete_checkpoint
        >>> latest_complete_checkpoint("/tmp/no-such-run") is None
        True
    """
    on_disk = _newest_complete_folder(output_dir, verify)
    from_memory = from_node_memory(output_dir, _TRAINER_FOLDERS, on_disk[0] if on_disk else -1)
    return from_memory if from_memory is not None else on_disk[1] if on_disk else None


def _newest_complete_folder(output_dir: str, verify: bool) -> tuple[int, str] | None:
    """``(step, folder)`` of the newest complete ``checkpoint-N`` of ``output_dir`` (this rank's view), or None."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), name) for name in names if (m := CHECKPOINT_FOLDER.match(name))), reverse=True)
    for step, name in steps:
        folder = os.path.join(output_dir, name)
        if not os.path.isdir(folder):
            continue
        problem = _incomplete(folder, verify)
        if problem is None:
            return step, folder
        log.warn(f"skipped {folder}: {problem}", all_ranks=True)
    return None


def _incomplete(folder: str, verify: bool) -> str | None:
    """Why ``folder`` is not a complete checkpoint (None if it is): the judgement ``ckpt verify`` makes."""
    return check_folder(folder, verify=verify).problem
