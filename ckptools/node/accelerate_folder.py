"""A snapshot of an Accelerator's state written out as the folder Accelerate's ``save_state`` writes.

`snapshot_to_state_folder` writes what `ckptools.integrations.accelerate_snapshots.Snapshots` snapshots
(``accelerate-snapshot-N.pt``) as the folder ``accelerator.load_state`` reads as its own, named as the
snapshot's metadata says (``step_N`` by default): ``model.safetensors`` (``pytorch_model.bin`` without safe
serialization; ``model_<i>`` for further models), ``optimizer.bin``, ``scheduler.bin`` (``_<i>``),
``scaler.pt``, ``random_states_<rank>.pkl`` (every process's random streams and Accelerate's ``step``),
``custom_checkpoint_<i>.pkl`` (the objects registered for checkpointing), ``ckptools-gradients-<rank>.pt``
(an open accumulation window's gradients), and ckptools' manifest last; into a temporary folder renamed
into place. Two callers: ``Snapshots.latest`` on a relaunch, when node memory holds a step newer than
every whole folder; and the keeper when the job died and nobody relaunched it. Neither needs accelerate.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

from ..layouts import check_folder, load_file, write_manifest
from ..per_rank import PER_RANK_KEY as PER_RANK
from ..rng import numpy_state, python_state
from ..storage import fresh_tmp, fsync_dir, resolve
from .trainer_folder import save_fsynced, snapshot_record, unshared

__all__ = ["ACCELERATE_GRADIENTS", "ACCELERATE_STATE", "newest_whole_state", "snapshot_to_state_folder"]

ACCELERATE_STATE = "ckptools.accelerate"  # the snapshot's metadata entry: what to write out, and the name
ACCELERATE_GRADIENTS = "ckptools-gradients-{rank}.pt"  # a process's open window, in an Accelerate folder
GRADIENTS_ENTRY = "ckptools.gradients"  # ckptools.owned.gradients.GRADIENTS_KEY, as the snapshot holds it


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
    meta = record.metadata
    step, layout = int(meta["step"]), meta[ACCELERATE_STATE]
    name = str(layout["name"])
    if newest_whole_state(output_dir, name) >= step:
        return None
    os.makedirs(output_dir, exist_ok=True)
    final = os.path.join(output_dir, name.format(step=step))
    tmp = fresh_tmp(output_dir, os.path.basename(final))  # a killed earlier write-out's folder goes first
    os.mkdir(tmp)
    try:
        _write_folder(tmp, data, layout, record.rng or [])
        write_manifest(tmp)  # last: what latest_complete_state checks the folder by
        if os.path.exists(final):  # torn (not whole: newest_whole_state passed it over)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(output_dir)
    return final


def _numbered(base: str, i: int) -> str:
    """Accelerate's name of the i-th object's file: ``optimizer.bin``, ``optimizer_1.bin``."""
    return base if i == 0 else base.replace(".", f"_{i}.", 1)


def _write_folder(folder: str, data: dict[str, Any], layout: dict[str, Any], streams: list[Any]) -> None:
    for i in range(int(layout["models"])):
        weights = data[f"model_{i}"]
        if layout.get("safe_serialization", True):
            from safetensors.torch import save_file

            save_file(
                unshared(weights), os.path.join(folder, _numbered("model.safetensors", i)), metadata={"format": "pt"}
            )
        else:
            save_fsynced(weights, os.path.join(folder, _numbered("pytorch_model.bin", i)))
    for kind, base in (("optimizer", "optimizer.bin"), ("scheduler", "scheduler.bin")):
        for i in range(int(layout[f"{kind}s"])):
            save_fsynced(data[f"{kind}_{i}"], os.path.join(folder, _numbered(base, i)))
    if data.get("scaler") is not None:
        save_fsynced(data["scaler"], os.path.join(folder, "scaler.pt"))
    step = int(data["accelerator"]["step"])
    for rank, rng in enumerate(streams):
        save_fsynced(_accelerate_rng(rng, step), os.path.join(folder, f"random_states_{rank}.pkl"))
    for i in range(int(layout["customs"])):
        save_fsynced(data[f"custom_{i}"], os.path.join(folder, f"custom_checkpoint_{i}.pkl"))
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
