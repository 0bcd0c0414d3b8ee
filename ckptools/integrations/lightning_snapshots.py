"""Lose at most one step inside Lightning: `NodeSnapshots` puts Lightning's own checkpoint into node memory after
every training step (`ckptools.CheckpointManager.snapshot`: two slots, the copy is the stall, the commit in
the background, the keeper), and offers the newest one to ``trainer.fit(model, ckpt_path="last")``.

How a relaunch finds it: Lightning resolves ``ckpt_path="last"`` to the newest (by modification time) of every
``ModelCheckpoint``'s ``last*.ckpt`` and every ``OnExceptionCheckpoint``'s ``ckpt_path``, before any hook
runs. `NodeSnapshots` is an ``OnExceptionCheckpoint`` whose ``ckpt_path`` is the newest snapshot in this
node's memory (committed, or copied whole by every rank and then sealed: `ckptools.node.sealing`), or, once
the keeper persisted it (the job died and nobody relaunched within its grace), the file it wrote into
``dirpath`` (``last-snapshot-0000000123.ckpt``: an ordinary Lightning checkpoint that ``load_from_checkpoint``
reads, named as Lightning names its ``last*.ckpt``, so that ``ckpt_path="last"`` finds it without
`NodeSnapshots` too, and dated when the snapshot was taken). Like every ``OnExceptionCheckpoint``, it makes
``trainer.fit(model)`` without ``ckpt_path`` resume from ``"last"`` too (Lightning's rule for fault-tolerant
checkpoints). It writes nothing on an exception (the newest snapshot is a step old at most) and removes
nothing at teardown."""

from __future__ import annotations

import os
from typing import Any

from ..manager import CheckpointManager
from ..node import checkpoint_names, seal, watch
from ..owned.gradients import track
from ..write import replicas_switch
from . import LIGHTNING_PREFIX, NEEDS_LIGHTNING, lightning_classes
from .lightning_resume import COMPARED_BY_SNAPSHOT, replicas_to_compare

__all__ = ["NodeSnapshots"]

PREFIX = LIGHTNING_PREFIX  # its snapshots' and persisted files' names: last-snapshot-0000000123.ckpt

_BASES = lightning_classes("OnExceptionCheckpoint", "pytorch_lightning.callbacks", "lightning.pytorch.callbacks")
if not _BASES:
    raise ImportError(NEEDS_LIGHTNING)


class NodeSnapshots(_BASES[0]):  # type: ignore[misc,valid-type,unused-ignore]  # a class from a list: Any to mypy
    """A Lightning callback that snapshots Lightning's checkpoint into node memory every
    ``every_n_train_steps`` steps, within ``budget`` of the loop's time.

    Args:
        dirpath: the folder of the run's checkpoints (the ``ModelCheckpoint``'s ``dirpath``): where the
            keeper persists the newest snapshot, and what names this run's node memory. A relaunch
            finds its snapshots before Lightning runs any hook, so the folder is given here.
        every_n_train_steps: take a snapshot after every n-th optimizer step.
        budget: the fraction of the loop's time the snapshots may stall it (``0.02``: 2 %), as
            `ckptools.CheckpointManager.snapshot`'s: calls beyond it are skipped alike on every rank, and
            each change of cadence is logged with the steps a kill then loses. None (the default): every call.
        replicas: under DDP, how much of the ranks' replicas of the model and the optimizers to compare
            before each snapshot: ``"auto"`` (the default) and ``"sample"`` a rotating 1/50, ``"all"`` every
            byte, ``"off"`` none (`ckptools.CheckpointManager.snapshot`'s): `ReplicaMismatchError` on every
            rank and nothing kept when one copy changed alone.
        check_replicas: deprecated (goes in 0.6): ``False`` is ``replicas="off"``.

    Examples:
        >>> from ckptools.integrations.lightning import NodeSnapshots  # doctest: +SKIP
        >>> trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True),
        ...                              NodeSnapshots("ckpts")])  # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(
        self,
        dirpath: Any,
        *,
        every_n_train_steps: int = 1,
        budget: float | None = None,
        replicas: str = "auto",
        check_replicas: bool | None = None,
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        super().__init__(os.fspath(dirpath), filename=PREFIX)
        self.replicas = replicas_switch(replicas, "NodeSnapshots", check_replicas=check_replicas)
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be at least 1, got {every_n_train_steps}")
        self.every_n_train_steps = every_n_train_steps
        self.budget = budget
        self.manager = CheckpointManager(self.dirpath, keep_last=1, prefix=PREFIX)

    @property
    def ckpt_path(self) -> str:
        """The newest of this node's committed snapshots and the snapshots persisted into ``dirpath``
        (what ``ckpt_path="last"`` weighs against the ``ModelCheckpoint``'s files); a path that does
        not exist when there is none."""
        # A copy every rank finished whose commit a kill cut short counts: sealed first (ckptools.node.sealing).
        seal(self.manager.snapshot_dir, checkpoint_names(PREFIX))
        found = [*self.manager.checkpoints(), *self.manager.snapshots()]
        if not found:
            return os.path.join(self.dirpath, f"{PREFIX}-none.pt")
        _, path = max(found, key=lambda item: (item[0], item[1].startswith(self.manager.snapshot_dir)))
        if path.startswith(self.manager.snapshot_dir):
            watch(self.manager.snapshot_dir)  # the keeper of a killed job waits: this process reads it
        return path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_train_steps or getattr(trainer, "sanity_checking", False):
            return
        COMPARED_BY_SNAPSHOT[0] = True  # the snapshot compares DDP's replicas, ExactResume need not
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            COMPARED_BY_SNAPSHOT[0] = False
        compare = replicas_to_compare(trainer) if self.replicas != "off" else None
        self.manager.snapshot(checkpoint, step, budget=self.budget, replicas=self.replicas, compare=compare)

    def on_exception(self, trainer: Any, *_: Any, **__: Any) -> None:
        """Nothing: the newest snapshot is at most one step old (Lightning's would save a file here)."""

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """A fit that ended (every rank): finish the snapshot being committed. The newest stays in node
        memory; the keeper persists it once the job is gone, if it is newer than every file of its own."""
        self.manager.close()

    def teardown(self, trainer: Any, *_: Any, **__: Any) -> None:
        """Nothing is removed (Lightning's ``OnExceptionCheckpoint`` removes its file here)."""
