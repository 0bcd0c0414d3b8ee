"""An Accelerator's state in node memory every step: a kill -9 loses at most one step.

`Snapshots.take(step)` copies what ``accelerator.save_state`` would write at that step into node memory
(`ckptools.CheckpointManager.snapshot`: two slots, the copy is the stall, the commit in the background,
the keeper): the prepared models' weights, the optimizers', schedulers' and grad scaler's states, the
objects registered for checkpointing (a `ckptools.integrations.accelerate_data.ResumableLoader`'s place
in the epoch), every process's random streams, Accelerate's ``step`` and an open accumulation window's
gradients. It is written out as the folder Accelerate's ``save_state`` writes (``step_N/``,
`ckptools.node.write_outs`): by `Snapshots.latest` on a relaunch, when node memory holds a step
newer than every whole folder, and by the keeper when the job died and nobody relaunched it. Either way
``accelerator.load_state(folder)`` reads it as its own. A `Snapshots` attaches its accelerator
(`ckptools.integrations.accelerate.attach`): that ``load_state`` puts a window's gradients back.
"""

from __future__ import annotations

import os
from typing import Any

from ..layouts import ACCELERATE, AccelerateLayout
from ..manager import CheckpointManager
from ..node import newest_whole_state, snapshot_to_state_folder
from ..owned.gradients import track
from ..write import replicas_switch
from ._memory_folders import FolderKind, from_node_memory
from .accelerate import attach, replicas_of, state_of

__all__ = ["Snapshots"]


class Snapshots:
    """Node-memory snapshots of ``accelerator``'s state for the run folder ``output_dir`` (see the module).

    Args:
        accelerator: the ``accelerate.Accelerator``, after ``prepare`` and ``register_for_checkpointing``.
        output_dir: where the script's ``save_state`` folders are (``args.output_dir``).
        name: the folder a snapshot is written out as, ``{step}`` its step: the script's own naming of its
            ``save_state`` folders (complete_cv_example's ``step_{step}``).
        budget: the fraction of the loop's time snapshots may stall it (`ckptools.CheckpointManager.snapshot`'s).
        replicas: under DDP, how much of the processes' replicas of the models and optimizers to compare
            before each snapshot and ``save_state`` (`ReplicaMismatchError` on every process, nothing kept, when
            one copy changed alone): ``"auto"`` (the default) a rotating 1/50 before a snapshot and every byte
            before ``save_state``; ``"all"`` every byte, ``"sample"`` the 1/50, ``"off"`` none, before both.
        check_replicas: deprecated (goes in 0.6): ``False`` is ``replicas="off"``.

    Collective like ``save_state``: every process makes it and calls `take` and `latest` at the same steps.

    Examples:
        >>> from ckptools.integrations.accelerate_snapshots import Snapshots
        >>> snapshots = Snapshots(accelerator, args.output_dir)  # doctest: +SKIP
        >>> path = snapshots.latest()  # node memory's newer step written out first  # doctest: +SKIP
        >>> snapshots.take(overall_step)  # after each step  # doctest: +SKIP
    """

    def __init__(
        self,
        accelerator: Any,
        output_dir: str,
        *,
        name: str = "step_{step}",
        budget: float | None = None,
        replicas: str = "auto",
        check_replicas: bool | None = None,
    ) -> None:
        track()  # the optimizer steps watched from here: an open accumulation window's gradients
        if "{step}" not in name or os.sep in name:
            raise ValueError(f"name must be a folder name holding {{step}} (step_{{step}}), got {name!r}")
        self.accelerator = accelerator
        self.output_dir = output_dir
        self.name = name
        self.budget = budget
        self.replicas = replicas_switch(replicas, "Snapshots", check_replicas=check_replicas)
        self.manager = CheckpointManager(output_dir, prefix=ACCELERATE.prefix)
        # Its folders hold an open window's gradients: the accelerator's load_state puts them back (attach).
        attach(accelerator, replicas=self.replicas)

    def _state(self) -> tuple[dict[str, Any], AccelerateLayout]:
        """The snapshot's state (what ``save_state`` writes) and how its folder is laid out."""
        acc = self.accelerator
        entry = AccelerateLayout.entry
        state = state_of(acc)
        state.update({entry("scheduler", i): s for i, s in enumerate(acc._schedulers)})
        state.update({entry("custom", i): c for i, c in enumerate(acc._custom_objects)})
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        state["accelerator"] = acc  # its step: the position in an accumulation window
        layout = AccelerateLayout(
            self.name, len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._custom_objects)
        )
        return state, layout

    def take(self, step: int, *, blocking: bool = False) -> str | None:
        """Snapshot the state at ``step`` into node memory (`ckptools.CheckpointManager.snapshot`); its path,
        or None when the budget skipped this step."""
        state, layout = self._state()
        compare = replicas_of(self.accelerator) if self.replicas != "off" else None
        return self.manager.snapshot(state, step, blocking=blocking, metadata=layout.to_metadata(),
                                     budget=self.budget, replicas=self.replicas, compare=compare)  # fmt: skip

    def latest(self) -> str | None:
        """The folder to resume from: node memory's newest snapshot written out as ``name`` when it is newer
        than every whole folder of ``output_dir``, else the newest whole folder, or None (collective where
        a process group exists: every process gets the same folder)."""
        newest = newest_whole_state(self.output_dir, self.name)
        kind = FolderKind(ACCELERATE.prefix, lambda step: self.name.format(step=step), snapshot_to_state_folder,
                          "Snapshots.latest")  # fmt: skip
        from_memory = from_node_memory(self.output_dir, kind, newest)
        if from_memory is not None:
            return from_memory
        return os.path.join(self.output_dir, self.name.format(step=newest)) if newest >= 0 else None

    def close(self) -> None:
        """Wait for the snapshot in flight, release node memory at the job's normal end (`CheckpointManager.close`)."""
        self.manager.close()
