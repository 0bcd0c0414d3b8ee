"""The HF Trainer's state in node memory: what `CkptoolsCallback` snapshots at each optimizer step.

`CkptoolsCallback(snapshot_every=1)` (`ckptools.integrations.transformers`) takes a snapshot at each
optimizer step's end (``on_step_end``: the step is counted, the optimizer and the scheduler have
stepped) of what ``_save_checkpoint`` would write at that step: the model's weights, the optimizer's,
the scheduler's and the grad scaler's states, ``trainer_state.json``, the model's configs, and every
rank's random streams (`ckptools.CheckpointManager.snapshot`: two slots, the copy is the stall, the
commit in the background, the keeper). A snapshot is one torch file named ``trainer-snapshot-N.pt``.

It is written out as the ``checkpoint-N/`` folder the Trainer itself writes by
`ckptools.node.write_outs.snapshot_to_folder` (which the keeper needs, and which needs no
transformers): on a relaunch by `ckptools.integrations.transformers.latest_complete_checkpoint`, and by
the keeper when the job died and nobody relaunched it.

Not in a snapshot: ``training_args.bin`` (a pickled ``TrainingArguments``, which no resume reads), the
states of callbacks other than ``TrainerControl`` (``TrainerState.stateful_callbacks``, restored only
with ``restore_callback_states_from_checkpoint``) and the floating-point operations counted since the
last log (``total_flos``, a reported figure): those two are as of the Trainer's last save or log.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..layouts import TRAINER, TRAINER_FOLDERS
from ..node import snapshot_to_folder

__all__ = ["snapshot_to_folder"]

PREFIX = TRAINER.prefix  # trainer-snapshot-0000000123.pt; the keeper persists these as checkpoint-123/
CHECKPOINT_FOLDER = TRAINER_FOLDERS  # the Trainer's folders, the step in group 1


def capture(args: Any, state: Any, control: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
    """What ``_save_checkpoint`` would write at this step, as one state for `CheckpointManager.snapshot`
    (every rank's random streams are in every ckptools file already: ``__ckptools__["rng"]``)."""
    config = getattr(model, "config", None)
    generation = getattr(model, "generation_config", None)
    scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer holds the GradScaler
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": lr_scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "trainer_state": _state_json(state, control),
        "config": config.to_json_string() if config is not None and hasattr(config, "to_json_string") else None,
        "generation_config": generation.to_json_string() if generation is not None else None,
        "cuda_device": torch.cuda.current_device() if torch.cuda.is_initialized() else None,  # type: ignore[no-untyped-call]
        "world_size": int(getattr(args, "world_size", 1)),
    }


def _state_json(state: Any, control: Any) -> str:
    """``trainer_state.json`` as ``TrainerState.save_to_json`` writes it, the ``TrainerControl``'s state
    as of now (``_save_checkpoint`` puts it in too; the other callbacks' are as of the last save)."""
    import dataclasses

    fields = dataclasses.asdict(state)
    for rank_of_this_process in ("is_local_process_zero", "is_world_process_zero"):
        if rank_of_this_process in fields:  # as process 0 writes them; the Trainer sets both anew at a resume
            fields[rank_of_this_process] = True
    if hasattr(control, "state") and isinstance(fields.get("stateful_callbacks"), dict):
        fields["stateful_callbacks"]["TrainerControl"] = control.state()
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"
