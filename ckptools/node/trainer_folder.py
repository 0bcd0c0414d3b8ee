"""A snapshot of the HF Trainer's state written out as the ``checkpoint-N/`` folder the Trainer itself writes.

`snapshot_to_folder` writes what `ckptools.integrations.transformers.CkptoolsCallback` snapshots
(``trainer-snapshot-N.pt``) as the folder ``trainer.train(resume_from_checkpoint=...)`` reads as its
own: ``model.safetensors`` (a storage two names share, tied weights, once: what ``save_pretrained``
does), ``config.json``, ``generation_config.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
``rng_state.pth`` (one process) or ``rng_state_<rank>.pth``, ``trainer_state.json``, and ckptools'
manifest last; into a temporary folder renamed into place, so that a folder under its name is whole.
Two callers: `ckptools.integrations.transformers.latest_complete_checkpoint` on a relaunch, when node
memory holds a step newer than every folder; and the keeper (`ckptools.node.keeper`, which knows these
snapshots by their prefix, `ckptools.node.names.TRAINER_PREFIX`) when the job died and nobody
relaunched it. Neither needs transformers; the keeper imports this module (and torch) only then.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from ..codecs.record import Record, record_of
from ..errors import CheckpointFormatError
from ..layouts import load_file, write_manifest
from ..rng import numpy_state, python_state
from ..storage import fresh_tmp, fsync_dir, resolve
from .names import TRAINER_FOLDER

__all__ = ["newest_folder_step", "save_fsynced", "snapshot_to_folder", "unshared"]


def newest_folder_step(output_dir: str) -> int:
    """The step of the newest ``checkpoint-N`` folder in ``output_dir`` (complete or not), or -1."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return -1
    return max((int(m.group(1)) for n in names if (m := TRAINER_FOLDER.match(n))), default=-1)


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
    record = snapshot_record(data, snapshot)
    step = int(record.metadata["step"])
    if newest_folder_step(output_dir) >= step:
        return None
    os.makedirs(output_dir, exist_ok=True)
    name = f"checkpoint-{step}"
    tmp = fresh_tmp(output_dir, name)  # a killed earlier write-out's folder goes first
    os.mkdir(tmp)
    try:
        _write_folder(tmp, data, record)
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


def _write_folder(folder: str, data: dict[str, Any], record: Record) -> None:
    from safetensors.torch import save_file

    save_file(unshared(data["model"]), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    for key, file in (("config", "config.json"), ("generation_config", "generation_config.json")):
        if data.get(key) is not None:
            _write_text(os.path.join(folder, file), data[key])
    save_fsynced(data["optimizer"], os.path.join(folder, "optimizer.pt"))
    save_fsynced(data["scheduler"], os.path.join(folder, "scheduler.pt"))
    if data.get("scaler") is not None:
        save_fsynced(data["scaler"], os.path.join(folder, "scaler.pt"))
    streams = record.rng or []
    world = int(data.get("world_size") or len(streams))
    for rank, rng in enumerate(streams):
        file = "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"
        save_fsynced(_trainer_rng(rng, world, data.get("cuda_device")), os.path.join(folder, file))
    _write_text(os.path.join(folder, "trainer_state.json"), data["trainer_state"])


def snapshot_record(data: dict[str, Any], snapshot: str) -> Record:
    """The ckptools record of a snapshot in node memory (`ckptools.codecs.record`), with its streams.

    Raises:
        CheckpointFormatError: it has none (not a snapshot ckptools wrote); CheckpointVersionError:
            a newer ckptools wrote it.
    """
    record = record_of(data, snapshot)
    if record is None or record.rng is None or "step" not in record.metadata:
        raise CheckpointFormatError(f"{snapshot} holds no ckptools record with a step: not a snapshot ckptools wrote")
    return record


def unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
    out: dict[str, Any] = {"python": python_state(rng["python"]), "cpu": rng["torch"]}
    if "numpy" in rng:
        out["numpy"] = numpy_state(rng["numpy"])
    if "cuda" in rng:  # several processes: every device's (get_rng_state_all); one: the current device's
        out["cuda"] = rng["cuda"] if world > 1 else rng["cuda"][cuda_device or 0]
    return out


def save_fsynced(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, the file fsynced before it returns."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
