"""Names and places, without torch: a manager's numbered files (one pattern for the manager, its
node-memory slots, the keeper and the integrations; each framework's suffix from its entry in
`ckptools.layouts.frameworks`), the node-memory folder's default name, and whether a
folder may hold this user's snapshots (`claim`, `readable`: `ckptools.storage.make_private`).

Imports nothing of ckptools (the keeper and a run folder's listing, which import no torch, take it).

Examples:
    >>> checkpoint_names("ckpt").fullmatch("ckpt-0000000300.pt").group(1)
    '0000000300'
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import re
import secrets
import shutil
import tempfile

from .. import log
from ..errors import NodeMemoryError
from ..layouts import framework_of
from ..storage import make_private, private_problem

__all__ = [
    "ENV",
    "checkpoint_names",
    "claim",
    "default_folder",
    "file_name",
    "readable",
]

# The base folder of node memory (else /dev/shm): each run's folder is made inside it.
ENV = "CKPTOOLS_NODE_MEMORY"


def _suffix(prefix: str) -> str:
    framework = framework_of(prefix)
    return framework.suffix if framework is not None else ".pt"


def file_name(prefix: str, step: int) -> str:
    """The name of the checkpoint (or snapshot) of ``step``: zero-padded, so that names sort by step.

    Examples:
        >>> file_name("ckpt", 300), file_name("last-snapshot", 300)
        ('ckpt-0000000300.pt', 'last-snapshot-0000000300.ckpt')
    """
    return f"{prefix}-{step:010d}{_suffix(prefix)}"


def checkpoint_names(prefix: str) -> re.Pattern[str]:
    """The file names `CheckpointManager` gives its checkpoints and snapshots (``ckpt-0000000300.pt``),
    the step in group 1: the one pattern the manager and the keeper both list by."""
    return re.compile(rf"{re.escape(prefix)}-(\d+){re.escape(_suffix(prefix))}")


def default_folder(directory: str, prefix: str) -> str:
    """The node-memory folder of a manager of ``directory`` with ``prefix`` on this node.

    Examples:
        >>> os.path.basename(default_folder("/runs/a", "ckpt")).startswith("ckptools-")
        True
        >>> default_folder("/runs/a", "ckpt") != default_folder("/runs/b", "ckpt")  # one folder per run
        True
    """
    where = directory if "://" in directory else os.path.abspath(directory)
    key = hashlib.sha1(f"{where}\0{prefix}".encode()).hexdigest()[:16]
    base = os.environ.get(ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(base, f"ckptools-{_user()}-{key}")


def _user() -> str:
    """This user's name as a folder's name carries it (``uid1001`` where it has none)."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    name = ""
    with contextlib.suppress(ImportError, KeyError, TypeError):
        import pwd

        name = pwd.getpwuid(uid).pw_name  # type: ignore[arg-type]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:32]
    return name or (f"uid{uid}" if uid is not None else "user")


def _refusal(folder: str, problem: str) -> str:
    return (
        f"the node-memory folder {folder} is not yours alone: {problem}. ckptools never uses such a folder "
        "(whoever can write into it could read, replace or forge your snapshots): remove it (its owner or root "
        f"can), or point CheckpointManager(snapshot_dir=...) or ${ENV} at a folder of your own (it is made 0700)"
    )


def claim(folder: str) -> None:
    """Make ``folder`` this user's node-memory folder (mode 0700), or check the one there.

    Raises:
        NodeMemoryError: it, or a folder above it, is not this user's alone (`ckptools.storage.make_private`):
            another user's, writable by others, a link; the message names it and the fix.
    """
    problem = make_private(folder)
    if problem is not None:
        raise NodeMemoryError(_refusal(folder, problem))


def readable(folder: str) -> bool:
    """Whether snapshots may be read from ``folder``: it exists and is this user's alone. One that
    exists and is not is never read (a `CheckpointWarning` says so, once per folder and process)."""
    if not os.path.lexists(folder):
        return False
    problem = private_problem(folder)
    if problem is None:
        return True
    log.warn(f"{_refusal(folder, problem)}; its snapshots were not read", once=f"node memory {folder}", all_ranks=True)
    return False


def discard(folder: str) -> bool:
    """Remove the node-memory ``folder`` and everything in it; whether it was there.

    Renamed out of its name first, then emptied: a process that writes into it by name while it goes
    (a keeper starting late creates its lock, a rank registers its pid) then finds no folder, instead
    of adding a file between the listing and the last ``rmdir`` (which failed the job's normal end
    with "Directory not empty"). Where the rename is refused (a parent that is not writable), it is
    emptied in place, again while files keep appearing.

    Example:
        >>> discard("/dev/shm/ckptools-alice-0123abcd")  # doctest: +SKIP
        True
    """
    gone = f"{folder}.released-{secrets.token_hex(6)}"  # unguessable: nobody made it first
    try:
        os.rename(folder, gone)
    except FileNotFoundError:
        return False
    except OSError:
        gone = folder
    for _ in range(100):
        try:
            shutil.rmtree(gone)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno != errno.ENOTEMPTY:
                raise
    shutil.rmtree(gone)
    return True


def sweep_released(folder: str) -> list[str]:
    """Remove what a release of ``folder`` killed while it emptied it left under another name
    (``discard``'s ``FOLDER.released-*``); the paths removed. Only this user's own folders go: a link or
    another user's folder of that name is left alone, never followed."""
    removed = []
    for released in sorted(glob.glob(glob.escape(folder) + ".released-*")):
        if os.path.isdir(released) and not os.path.islink(released) and private_problem(released) is None:
            with contextlib.suppress(OSError):
                shutil.rmtree(released)
                removed.append(released)
    return removed
