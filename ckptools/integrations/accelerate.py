"""Accelerate's ``save_state`` / ``load_state``, whole or absent, and the newest whole folder to resume from.

``Accelerator.save_state(dir)`` writes into ``dir`` itself, file by file, every process its own
``random_states_<rank>.pkl`` last: a kill inside it leaves a folder that ``--resume_from_checkpoint
latest`` picks and ``load_state`` loads without a word (it logs the missing RNG file at INFO). Here:

- `save_state` has Accelerate write the folder beside its name (``.NAME.ckptools-partial``), waits for
  every process, then rank 0 writes ``ckptools-manifest.json`` (every file's size and CRC-32) and renames
  the folder into place (the directory fsynced): the name holds a whole folder or nothing. With
  ``total_limit``, the oldest whole folders beyond it go only after the new one is in place.
- `load_state` refuses a folder that is not whole (`CheckpointFormatError` naming what is missing or cut
  short: the judgement ``ckpt verify`` makes), then has Accelerate load it.
- `latest_complete_state` is the newest whole folder under a parent (``step_N``, ``epoch_N``,
  ``checkpoint_N``: a number at the end of the name), for ``--resume_from_checkpoint``.
- `attach` makes the accelerator's own ``save_state`` / ``load_state`` these (a script keeps its calls):
  with ``ProjectConfiguration(automatic_checkpoint_naming=True)`` ``save_state()`` names the folder
  as Accelerate does and prunes to ``total_limit`` after it is whole, and ``load_state()`` loads the
  newest whole one and numbers the next save after it; a ``load_state`` of a torn folder raises
  (Accelerate's load pre-hook).
- Open gradient-accumulation windows (`ckptools.owned.gradients`): each process's gradients summed since the
  last optimizer step go into ``ckptools-gradients-<rank>.pt`` in the folder, and back into ``.grad``
  at the load; Accelerate's ``step`` (the position in the window) is in its own RNG file.

Collective like ``save_state`` itself: every process calls them. The folder must be one every process
sees (a shared filesystem, or one node).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Any

import torch

from .. import log
from ..collective.agree import Agreement, first_failure
from ..collective.group import all_gather_object, get_rank, get_world_size
from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..layouts import (
    ACCELERATE_GRADIENTS,
    MANIFEST,
    AccelerateLayout,
    accelerate_file,
    accelerate_pattern,
    check_folder,
    files_whole,
    write_manifest,
)
from ..owned.gradients import mark_restored, open_gradients, put_back_gradients, track
from ..storage import fsync_dir
from ..write import compare_now, replicas_switch
from . import replicated

__all__ = ["attach", "latest_complete_state", "load_state", "save_state"]

_ORIGINALS = "_ckptools_originals"  # on an attached Accelerator: its own (save_state, load_state)

PARTIAL = ".ckptools-partial"
_SAMPLERS = accelerate_pattern("sampler", "dl_state_dict")  # read by load_state where present
_NUMBERED = re.compile(r"^(?!\.).*?(\d+)$")


def _partial(output_dir: str) -> str:
    parent, name = os.path.split(os.path.abspath(output_dir).rstrip("/"))
    return os.path.join(parent, f".{name}{PARTIAL}")


def save_state(accelerator: Any, output_dir: str, *, total_limit: int | None = None, **kwargs: Any) -> str:
    """``accelerator.save_state(output_dir, **kwargs)``, whole or absent (see the module); the folder.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        output_dir: the folder to write (``run/step_100``); an earlier one of that name is replaced
            only once the new one is whole.
        total_limit: keep the newest this many whole folders of ``output_dir``'s parent (numbered
            names holding a manifest), removed after the new one is in place; None keeps all.
        **kwargs: passed to ``save_state`` (``safe_serialization``).

    Raises:
        CheckpointError: on every process, when writing or sealing failed; the earlier folders are intact.

    Examples:
        >>> from ckptools.integrations.accelerate import save_state
        >>> save_state(accelerator, "run/step_100", total_limit=3)  # doctest: +SKIP
        'run/step_100'
    """
    originals = getattr(accelerator, _ORIGINALS, None)
    return _whole(accelerator, originals[0] if originals else None, output_dir, total_limit, kwargs)


def _whole(accelerator: Any, inner: Any, output_dir: str, total_limit: int | None, kwargs: dict[str, Any]) -> str:
    """`save_state`: ``inner`` is the accelerator's own ``save_state`` when `attach` replaced it (its
    pre-hook then writes the gradients), else None."""
    final = os.path.abspath(output_dir).rstrip("/")
    partial = _partial(final)
    agreement = Agreement(f"saving the Accelerate state {final}", tail="; earlier folders are untouched")
    agreement.on_rank0(lambda: _clear(os.path.dirname(final)))  # killed saves' folders: never resumed from
    accelerator.wait_for_everyone()
    error: BaseException | None = None
    try:
        if inner is not None:
            inner(partial, **kwargs)
        else:
            accelerator.save_state(partial, **kwargs)
            _save_gradients(accelerator, partial)
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = err
    agreement.on_every_rank(error)  # every process's files are in (its random_states last)
    agreement.on_rank0(lambda: _seal(partial, final, total_limit))
    return output_dir


def state_of(accelerator: Any) -> dict[str, Any]:
    """The accelerator's models and optimizers, named as `ckptools.owned.gradients` sees a state (and as
    `ckptools.integrations.accelerate_snapshots` snapshots them: the names its folders' gradients carry)."""
    entry = AccelerateLayout.entry
    state: dict[str, Any] = {entry("model", i): m for i, m in enumerate(accelerator._models)}
    state.update({entry("optimizer", i): o for i, o in enumerate(accelerator._optimizers)})
    return state


def replicas_of(accelerator: Any) -> dict[str, Any]:
    """The accelerator's models and optimizers when every process holds them alike (DDP: a ``MULTI_*``
    distributed type; its ``_models`` are the modules DDP wraps), else nothing: FSDP's and DeepSpeed's
    are each process's own shards."""
    return state_of(accelerator) if replicated(getattr(accelerator, "distributed_type", None)) else {}


def _save_gradients(accelerator: Any, folder: str) -> None:
    """Every process: its open accumulation window's gradients into ``folder`` (nothing when closed)."""
    own = open_gradients(state_of(accelerator))
    if own:
        path = os.path.join(folder, ACCELERATE_GRADIENTS.format(rank=get_rank()))
        torch.save({"world_size": get_world_size(), "gradients": own}, path)


def _load_gradients(accelerator: Any, folder: str) -> None:
    """Every process: its gradients saved in ``folder``, back into ``.grad`` (`_save_gradients`)."""
    mark_restored(state_of(accelerator))  # whatever the models hold now was summed before this resume
    path = os.path.join(folder, ACCELERATE_GRADIENTS.format(rank=get_rank()))
    if not os.path.exists(path):
        return
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if int(saved["world_size"]) != get_world_size():
        log.warn(
            f"{folder} was saved inside a gradient-accumulation window by {saved['world_size']} processes, and this "
            f"job has {get_world_size()}: each process's gradients summed so far cannot be shared out again, so they "
            "are dropped and that window ends with other weights than an uninterrupted run's",
            once="accelerate-gradients-resized",
        )
        return
    put_back_gradients(saved["gradients"], state_of(accelerator), path)


def _refuse_torn(input_dir: str, accelerator: Any = None) -> None:
    """Collective (every process loads): `CheckpointFormatError` on every process, before anything is
    loaded, when the folder is not whole or lacks a file ``accelerator``'s load will read (a folder
    Accelerate wrote alone carries no manifest: a torn one can hold bare weights and nothing else)."""
    problem = check_folder(input_dir, verify=False).problem
    if problem is None and accelerator is not None and os.path.isdir(input_dir):
        expected = _read_by_load(accelerator, input_dir)
        problem = None if expected is None else files_whole(input_dir, expected)
    first = first_failure(all_gather_object(problem), lambda found: found)
    if first is not None:
        raise CheckpointFormatError(
            f"{input_dir}: {first}; the folder is not a whole Accelerate state for this accelerator, and nothing was "
            "loaded: resume from another (latest_complete_state(parent) gives the newest whole one)"
        )


def _read_by_load(accelerator: Any, input_dir: str) -> list[str] | None:
    """The files ``accelerator.load_state(input_dir)`` reads, named as Accelerate names them, for the objects
    registered with it (models, optimizers, schedulers, a scaler, custom objects, this process's random
    states; the samplers' and loaders' files where present); None where a plugin writes its own layout
    (DeepSpeed, FSDP, Megatron), which this does not know."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in {DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM}:
        return None

    names = []
    for i in range(len(accelerator._models)):
        model = accelerate_file("model", i)
        names.append(model if os.path.exists(os.path.join(input_dir, model)) else accelerate_file("bare_model", i))
    for kind, objects in (("optimizer", accelerator._optimizers), ("scheduler", accelerator._schedulers)):
        names += [accelerate_file(kind, i) for i in range(len(objects))]
    if getattr(accelerator, "scaler", None) is not None:
        names.append(accelerate_file("scaler"))
    names += [accelerate_file("custom", i) for i in range(len(accelerator._custom_objects))]
    # save_state's last file: a torn folder lacks it.
    names.append(accelerate_file("random_states", rank=accelerator.process_index))
    present = [n for n in os.listdir(input_dir) if _SAMPLERS.match(n)]
    return names + sorted(present)


def attach(accelerator: Any, *, replicas: str = "auto", check_replicas: bool | None = None) -> Any:
    """Make ``accelerator.save_state`` / ``load_state`` whole or absent (see the module); ``accelerator``.

    Call it once, on every process, after making the Accelerator; the script's own calls stay as
    they are. ``save_state(dir)`` is `save_state`; with automatic checkpoint naming, ``save_state()``
    writes ``project_dir/checkpoints/checkpoint_<iteration>`` and keeps ``total_limit`` whole ones.
    ``load_state(dir)`` refuses a torn folder; ``load_state()`` (automatic naming) loads the newest
    whole one and numbers the next save after it. Under DDP each ``save_state`` first compares the
    processes' replicas (``replicas=``: ``"auto"`` and ``"all"`` every byte, `ckptools.check_replicas`'s;
    ``"sample"`` a rotating 1/50; ``"off"`` none; ``check_replicas=False``, the old ``"off"``, warns and goes
    in 0.6): `ReplicaMismatchError` on every process, nothing written, when one copy changed alone.

    Examples:
        >>> from ckptools.integrations.accelerate import attach
        >>> accelerator = attach(Accelerator(project_config=ProjectConfiguration(  # doctest: +SKIP
        ...     project_dir="run", automatic_checkpoint_naming=True, total_limit=3)))
    """
    mode = replicas_switch(replicas, "attach", check_replicas=check_replicas)
    mode = "all" if mode == "auto" else mode  # a durable save: every byte
    if getattr(accelerator, _ORIGINALS, None) is not None:
        return accelerator
    track()  # from the loop's first optimizer step on: what each step consumed, for the windows' gradients
    own_save, own_load = accelerator.save_state, accelerator.load_state
    setattr(accelerator, _ORIGINALS, (own_save, own_load))
    config = accelerator.project_configuration

    def save(output_dir: str | None = None, **kwargs: Any) -> str:
        # Every process calls save_state: DDP's replicas compared first (every byte: a durable save), so a
        # copy changed on one process alone raises ReplicaMismatchError everywhere before anything is written.
        if mode != "off":
            compare_now(replicas_of(accelerator), sample=mode == "sample", declared=True)
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError("save_state() needs an output_dir, or automatic_checkpoint_naming in the project")
            return _whole(accelerator, own_save, output_dir, None, kwargs)
        final = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}")
        if os.path.exists(final) and check_folder(final, verify=False).problem is None:  # as Accelerate refuses
            raise ValueError(
                f"Checkpoint directory {final} ({accelerator.save_iteration}) already exists. Please manually "
                "override `self.save_iteration` with what iteration to start with."
            )
        if os.path.exists(final):  # torn (Accelerate's own save killed, before attach): replaced once whole
            log.warn(f"{final} is not whole ({check_folder(final, verify=False).problem}): this save replaces it")
        os.makedirs(os.path.dirname(final), exist_ok=True)
        config.automatic_checkpoint_naming = False  # its own save_state would prune first, and name it itself
        try:
            return _whole(accelerator, own_save, final, config.total_limit, kwargs)
        finally:
            config.automatic_checkpoint_naming = True

    def load(input_dir: str | None = None, **kwargs: Any) -> None:
        if input_dir is not None or not config.automatic_checkpoint_naming:
            own_load(input_dir, **kwargs)
            return
        parent = os.path.join(accelerator.project_dir, "checkpoints")
        newest = latest_complete_state(parent)
        if newest is None:
            raise CheckpointNotFoundError(f"{parent}: no whole checkpoint_<N> folder to load; start from scratch")
        own_load(newest, **kwargs)
        config.iteration = int(_NUMBERED.match(os.path.basename(newest)).group(1)) + 1  # type: ignore[union-attr]

    accelerator.register_save_state_pre_hook(lambda models, weights, folder: _save_gradients(accelerator, folder))
    accelerator.register_load_state_pre_hook(lambda models, folder: _before_load(accelerator, folder))
    accelerator.save_state, accelerator.load_state = save, load
    return accelerator


def _before_load(accelerator: Any, input_dir: str) -> None:
    _refuse_torn(input_dir, accelerator)
    _load_gradients(accelerator, input_dir)


def _clear(parent: str) -> None:
    """Rank 0, before a save: the folders of saves killed before their seal (one save runs at a time)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            if name.startswith(".") and (name.endswith(PARTIAL) or name.endswith(f"{PARTIAL}.old")):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _seal(partial: str, final: str, total_limit: int | None) -> None:
    """Rank 0: the manifest, the rename into place (an older folder of that name moved aside first),
    the directory fsynced, then the pruning."""
    write_manifest(partial)
    aside = None
    if os.path.exists(final):
        aside = f"{partial}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(partial, final)
    parent = os.path.dirname(final)
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if total_limit is not None:
        sealed = sorted(_numbered(parent, sealed_only=True))
        for _, folder in sealed[: max(len(sealed) - total_limit, 0)]:
            shutil.rmtree(folder, ignore_errors=True)


def _numbered(parent: str, *, sealed_only: bool = False) -> list[tuple[int, str]]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            match = _NUMBERED.match(name)
            folder = os.path.join(parent, name)
            if match and os.path.isdir(folder) and (not sealed_only or os.path.exists(os.path.join(folder, MANIFEST))):
                found.append((int(match.group(1)), folder))
    return found


def load_state(accelerator: Any, input_dir: str, **kwargs: Any) -> None:
    """``accelerator.load_state(input_dir, **kwargs)`` once the folder is known whole (every file its
    manifest lists, with its size; without a manifest, Accelerate's expected set).

    Raises:
        CheckpointFormatError: the folder is not whole, naming what is missing or cut short; nothing
            was loaded.

    Examples:
        >>> from ckptools.integrations.accelerate import load_state
        >>> load_state(accelerator, latest_complete_state("run"))  # doctest: +SKIP
    """
    originals = getattr(accelerator, _ORIGINALS, None)
    if originals is not None:  # attached: its pre-hook refuses a torn folder and puts the gradients back
        originals[1](input_dir, **kwargs)
        return
    _refuse_torn(input_dir, accelerator)
    accelerator.load_state(input_dir, **kwargs)
    _load_gradients(accelerator, input_dir)


def latest_complete_state(parent: str, *, verify: bool = False) -> str | None:
    """The newest whole Accelerate state folder under ``parent`` (numbered names: ``step_100``), or None.

    Whole: `ckptools.layouts.folder_check.check_folder`'s judgement (``verify``: every byte too). A folder
    that is not is skipped with a `ckptools.CheckpointWarning` saying why; a save cut short by a kill
    (``.NAME.ckptools-partial``) is never one of them.

    Examples:
        >>> from ckptools.integrations.accelerate import latest_complete_state
        >>> latest_complete_state("/tmp/no-such-run") is None
        True
    """
    for _, folder in sorted(_numbered(parent), reverse=True):
        problem = check_folder(folder, verify=verify).problem
        if problem is None:
            return folder
        log.warn(f"skipping {folder}: {problem}", once=f"accelerate-skip:{folder}")
    return None
