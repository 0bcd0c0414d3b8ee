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

Collective like ``save_state`` itself: every process calls them. The folder must be one every process
sees (a shared filesystem, or one node).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Any

from .. import log
from ..collective.agree import Agreement
from ..errors import CheckpointFormatError
from ..layouts import MANIFEST, check_folder, write_manifest
from ..storage import fsync_dir

__all__ = ["latest_complete_state", "load_state", "save_state"]

PARTIAL = ".ckptools-partial"
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
    final = os.path.abspath(output_dir).rstrip("/")
    partial = _partial(final)
    agreement = Agreement(f"saving the Accelerate state {final}", tail="; earlier folders are untouched")
    agreement.on_rank0(lambda: _clear(os.path.dirname(final)))  # killed saves' folders: never resumed from
    accelerator.wait_for_everyone()
    error: BaseException | None = None
    try:
        accelerator.save_state(partial, **kwargs)
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = err
    agreement.on_every_rank(error)  # every process's files are in (its random_states last)
    agreement.on_rank0(lambda: _seal(partial, final, total_limit))
    return output_dir


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
    problem = check_folder(input_dir, verify=False).problem
    if problem is not None:
        raise CheckpointFormatError(
            f"{input_dir}: {problem}; the folder is not a whole Accelerate state, and nothing was loaded: resume "
            "from another (latest_complete_state(parent) gives the newest whole one)"
        )
    accelerator.load_state(input_dir, **kwargs)


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
