"""The HF Trainer's state in node memory, and the ``checkpoint-N/`` folder made from it.

`CkptoolsCallback(snapshot_every=1)` (`ckptools.integrations.transformers`) takes a snapshot at each
optimizer step's end (``on_step_end``: the step is counted, the optimizer and the scheduler have
stepped) of what ``_save_checkpoint`` would write at that step: the model's weights, the optimizer's,
the scheduler's and the grad scaler's states, ``trainer_state.json``, the model's configs, and every
rank's random streams (`ckptools.CheckpointManager.snapshot`: two slots, the copy is the stall, the
commit in the background, the keeper). A snapshot is one torch file named ``trainer-snapshot-N.pt``.

`snapshot_to_folder` writes it out as the folder the Trainer itself would have written, which
``trainer.train(resume_from_checkpoint=...)`` reads as its own: ``model.safetensors`` (a storage two
names share, tied weights, once: what ``save_pretrained`` does), ``config.json``,
``generation_config.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth`` (one
process) or ``rng_state_<rank>.pth``, ``trainer_state.json``, and ckptools' manifest last; into a
temporary folder renamed into place, so that a folder under its name is whole. Two callers:
`ckptools.integrations.transformers.latest_complete_checkpoint` on a relaunch, when node memory holds
a step newer than every folder; and the keeper (`ckptools.keeper`, which knows these snapshots by their
prefix) when the job died and nobody relaunched it. Neither needs transformers.

Not in a snapshot: ``training_args.bin`` (a pickled ``TrainingArguments``, which no resume reads), the
states of callbacks other than ``TrainerControl`` (``TrainerState.stateful_callbacks``, restored only
with ``restore_callback_states_from_checkpoint``) and the floating-point operations counted since the
last log (``total_flos``, a reported figure): those two are as of the Trainer's last save or log.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from ..layouts import load_file, write_manifest
from ..snapshot_names import TRAINER_FOLDER, TRAINER_PREFIX
from ..storage import fresh_tmp, fsync_dir, resolve

__all__ = ["snapshot_to_folder"]

PREFIX = TRAINER_PREFIX  # trainer-snapshot-0000000123.pt; the keeper persists these as checkpoint-123/
CHECKPOINT_FOLDER = TRAINER_FOLDER  # the Trainer's folders, the step in group 1


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


def newest_folder_step(output_dir: str) -> int:
    """The step of the newest ``checkpoint-N`` folder in ``output_dir`` (complete or not), or -1."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return -1
    return max((int(m.group(1)) for n in names if (m := CHECKPOINT_FOLDER.match(n))), default=-1)


def snapshot_to_folder(snapshot: str, output_dir: str) -> str | None:
    """Write the snapshot ``snapshot`` as ``output_dir/checkpoint-N/``; its path, or None when a folder
    of that step or a newer one is there already (a newer folder is never replaced, nor an equal one).

    Examples:
        >>> from ckptools.integrations.transformers import snapshot_to_folder  # doctest: +SKIP
        >>> snapshot_to_folder("/dev/shm/ckptools-.../trainer-snapshot-0000000017.pt", "hf-run")  # doctest: +SKIP
        'hf-run/checkpoint-17'
    """
    # ckptools' reader: one open, a link refused (the snapshot is a file of this job's own), torch's weights-only load.
    data = load_file(resolve(snapshot).as_own(), map_location="cpu", mmap=True)
    step = int(data["__ckptools__"]["metadata"]["step"])
    if newest_folder_step(output_dir) >= step:
        return None
    os.makedirs(output_dir, exist_ok=True)
    name = f"checkpoint-{step}"
    tmp = fresh_tmp(output_dir, name)  # a killed earlier write-out's folder goes first
    os.mkdir(tmp)
    try:
        _write_folder(tmp, data)
        write_manifest(tmp)  # last: what latest_complete_checkpoint checks the folder by
        try:
            os.rename(tmp, os.path.join(output_dir, name))
        except OSError:  # made meanwhile by another process (another node's rank, or a keeper)
            if newest_folder_step(output_dir) < step:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(output_dir)
    return os.path.join(output_dir, name)


def _write_folder(folder: str, data: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file(_unshared(data["model"]), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    for key, file in (("config", "config.json"), ("generation_config", "generation_config.json")):
        if data.get(key) is not None:
            _write_text(os.path.join(folder, file), data[key])
    _save(data["optimizer"], os.path.join(folder, "optimizer.pt"))
    _save(data["scheduler"], os.path.join(folder, "scheduler.pt"))
    if data.get("scaler") is not None:
        _save(data["scaler"], os.path.join(folder, "scaler.pt"))
    streams = data["__ckptools__"]["rng"]
    world = int(data.get("world_size") or len(streams))
    for rank, rng in enumerate(streams):
        file = "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"
        _save(_trainer_rng(rng, world, data.get("cuda_device")), os.path.join(folder, file))
    _write_text(os.path.join(folder, "trainer_state.json"), data["trainer_state"])


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights safetensors can store: a tensor that another name already stores (tied weights)
    is left out, as ``save_pretrained`` does (loading one fills both); any other overlap is copied."""
    kept: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    storages: set[int] = set()
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        key = (storage, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))
        if key in seen:
            continue
        seen[key] = name
        kept[name] = tensor.clone() if storage in storages or not tensor.is_contiguous() else tensor
        storages.add(storage)
    return kept


def _trainer_rng(rng: dict[str, Any], world: int, cuda_device: int | None) -> dict[str, Any]:
    """One rank's streams (`ckptools.rng`'s form) as ``Trainer._save_rng_state`` writes them."""
    import numpy as np

    python = rng["python"]
    out: dict[str, Any] = {
        "python": (python["version"], tuple(int(x) for x in python["state"].tolist()), python["gauss"]),
        "cpu": rng["torch"],
    }
    if "numpy" in rng:
        n = rng["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        out["numpy"] = (n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
    if "cuda" in rng:  # several processes: every device's (get_rng_state_all); one: the current device's
        out["cuda"] = rng["cuda"] if world > 1 else rng["cuda"][cuda_device or 0]
    return out


def _save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
