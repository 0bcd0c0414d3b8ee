"""Each framework's snapshot written out as the folder that framework writes itself: the write-out table.

The entries of `ckptools.layouts.frameworks` whose checkpoints are folders name their function here
(``Framework.write_out``), ``f(snapshot, output_dir)`` -> the folder written, or None when a folder of that
step or a newer one is there already. Each writes into a temporary folder, ckptools' manifest last, renamed
into place, so that a folder under its name is whole. Two callers each: the framework's integration on a
relaunch, when node memory holds a step newer than every folder on disk; and the keeper
(`ckptools.node.keeper`, which finds the function by the snapshot's prefix) when the job died and nobody
relaunched it. None needs its framework installed; the keeper imports this module (and torch) only then.

- `snapshot_to_folder`: what `ckptools.integrations.transformers.CkptoolsCallback` snapshots
  (``trainer-snapshot-N.pt``) as the ``checkpoint-N/`` folder ``trainer.train(resume_from_checkpoint=...)``
  reads: ``model.safetensors`` (a storage two names share, tied weights, once: what ``save_pretrained``
  does), ``config.json``, ``generation_config.json``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
  ``rng_state.pth`` (one process) or ``rng_state_<rank>.pth``, ``trainer_state.json``.
- `snapshot_to_state_folder`: what `ckptools.integrations.accelerate_snapshots.Snapshots` snapshots
  (``accelerate-snapshot-N.pt``) as the folder ``accelerator.load_state`` reads, named and laid out as its
  `ckptools.layouts.AccelerateLayout` says (``step_N`` by default), its files named as Accelerate names
  them (`ckptools.layouts.accelerate_file`): the models, ``optimizer.bin``, ``scheduler.bin``,
  ``scaler.pt``, ``random_states_<rank>.pkl`` (every process's random streams and Accelerate's ``step``),
  ``custom_checkpoint_<i>.pkl``, ``ckptools-gradients-<rank>.pt`` (an open accumulation window's gradients).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch

from ..codecs.record import Record, record_of
from ..errors import CheckpointFormatError
from ..layouts import (
    ACCELERATE_GRADIENTS,
    TRAINER_FOLDERS,
    AccelerateLayout,
    accelerate_file,
    check_folder,
    load_file,
    write_manifest,
)
from ..per_rank import PER_RANK_KEY as PER_RANK
from ..rng import numpy_state, python_state
from ..storage import fresh_tmp, fsync_dir, resolve

__all__ = [
    "newest_folder_step",
    "newest_whole_state",
    "save_fsynced",
    "snapshot_to_folder",
    "snapshot_to_state_folder",
    "unshared",
]

GRADIENTS_ENTRY = "ckptools.gradients"  # ckptools.owned.gradients.GRADIENTS_KEY, as the snapshot holds it


# The HF Trainer's checkpoint-N/ folder.
def newest_folder_step(output_dir: str) -> int:
    """The step of the newest ``checkpoint-N`` folder in ``output_dir`` (complete or not), or -1."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return -1
    return max((int(m.group(1)) for n in names if (m := TRAINER_FOLDERS.match(n))), default=-1)


def snapshot_to_folder(snapshot: str, output_dir: str) -> str | None:
    """Write the snapshot ``snapshot`` as ``output_dir/checkpoint-N/``; its path, or None when a folder
    of that step or a newer one is there already (a newer folder is never replaced, nor an equal one).

    Examples:
        >>> from ckptools.node import snapshot_to_folder  # doctest: +SKIP
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
        _write_trainer_folder(tmp, data, record)
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


def _write_trainer_folder(folder: str, data: dict[str, Any], record: Record) -> None:
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


# Accelerate's save_state folder.


def _pattern(name: str) -> re.Pattern[str]:
    """``step_{step}`` as a pattern of its folders, the step in group 1."""
    return re.compile("^" + re.escape(name).replace(re.escape("{step}"), r"(\d+)") + "$")


def newest_whole_state(output_dir: str, name: str) -> int:
    """The step of the newest whole folder named by ``name`` (``step_{step}``) in ``output_dir``, or -1.

    Examples:
        >>> newest_whole_state("/tmp/no-such-run", "step_{step}")
        -1
    """
    pattern = _pattern(name)
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return -1
    steps = sorted((int(m.group(1)) for n in names if (m := pattern.match(n))), reverse=True)
    for step in steps:
        if check_folder(os.path.join(output_dir, name.format(step=step)), verify=False).problem is None:
            return step
    return -1


def snapshot_to_state_folder(snapshot: str, output_dir: str) -> str | None:
    """Write the snapshot ``snapshot`` as Accelerate's folder in ``output_dir``; its path, or None when a
    whole folder of that step or a newer one is there already (a torn one of that name is replaced).

    Examples:
        >>> snapshot_to_state_folder("/dev/shm/ckptools-.../accelerate-snapshot-0000000017.pt", "run")  # doctest: +SKIP
        'run/step_17'
    """
    # ckptools' reader: one open, a link refused (the snapshot is a file of this job's own), torch's weights-only load.
    data = load_file(resolve(snapshot).as_own(), map_location="cpu", mmap=True)
    record = snapshot_record(data, snapshot)
    step, layout = int(record.metadata["step"]), AccelerateLayout.from_metadata(record.metadata, snapshot)
    name = layout.name
    if newest_whole_state(output_dir, name) >= step:
        return None
    os.makedirs(output_dir, exist_ok=True)
    final = os.path.join(output_dir, name.format(step=step))
    tmp = fresh_tmp(output_dir, os.path.basename(final))  # a killed earlier write-out's folder goes first
    os.mkdir(tmp)
    try:
        _write_state_folder(tmp, data, layout, record.rng or [])
        write_manifest(tmp)  # last: what latest_complete_state checks the folder by
        if os.path.exists(final):  # torn (not whole: newest_whole_state passed it over)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(output_dir)
    return final


def _write_state_folder(folder: str, data: dict[str, Any], layout: AccelerateLayout, streams: list[Any]) -> None:
    entry = AccelerateLayout.entry
    for i in range(layout.models):
        weights = data[entry("model", i)]
        if layout.safe_serialization:
            from safetensors.torch import save_file

            save_file(unshared(weights), os.path.join(folder, accelerate_file("model", i)), metadata={"format": "pt"})
        else:
            save_fsynced(weights, os.path.join(folder, accelerate_file("bare_model", i)))
    for kind, count in (("optimizer", layout.optimizers), ("scheduler", layout.schedulers)):
        for i in range(count):
            save_fsynced(data[entry(kind, i)], os.path.join(folder, accelerate_file(kind, i)))
    if data.get("scaler") is not None:
        save_fsynced(data["scaler"], os.path.join(folder, accelerate_file("scaler")))
    step = int(data["accelerator"]["step"])
    for rank, rng in enumerate(streams):
        save_fsynced(_accelerate_rng(rng, step), os.path.join(folder, accelerate_file("random_states", rank=rank)))
    for i in range(layout.customs):
        save_fsynced(data[entry("custom", i)], os.path.join(folder, accelerate_file("custom", i)))
    gradients = data.get(GRADIENTS_ENTRY)
    if isinstance(gradients, dict) and isinstance(gradients.get(PER_RANK), list):
        world = len(gradients[PER_RANK])
        for rank, own in enumerate(gradients[PER_RANK]):
            if own:  # ckptools.integrations.accelerate's file of an open window
                save_fsynced(
                    {"world_size": world, "gradients": own},
                    os.path.join(folder, ACCELERATE_GRADIENTS.format(rank=rank)),
                )


def _accelerate_rng(rng: dict[str, Any], step: int) -> dict[str, Any]:
    """One process's streams (`ckptools.rng`'s form) as ``save_accelerator_state`` writes them."""
    out: dict[str, Any] = {"step": step, "random_state": python_state(rng["python"]), "torch_manual_seed": rng["torch"]}
    if "numpy" in rng:
        out["numpy_random_seed"] = numpy_state(rng["numpy"])
    if "cuda" in rng:  # every device's, as torch.cuda.get_rng_state_all() gives them
        out["torch_cuda_manual_seed"] = rng["cuda"]
    return out
