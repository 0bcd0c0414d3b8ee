"""Folders only this user can change: what node memory (``/dev/shm``, shared by every local user) needs.

A folder is this user's alone when it is a real folder (no symbolic link), belongs to this user, and
no group or other user may write into it; and no other user can replace it or a folder above it:
each folder above belongs to root or this user, and is writable by no one else unless it is sticky
(``/dev/shm`` and ``/tmp`` are: there, only an entry's owner may rename or remove it). Within such a
folder only this user (and root) can create, replace or remove a file, so what ckptools finds there
was written by this user's own processes. The threat model: docs/guarantees.md, "Node memory".

Examples:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp() + "/mine"
    >>> make_private(folder) is None, oct(os.stat(folder).st_mode & 0o777)
    (True, '0o700')
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = ["make_private", "owner_name", "private_problem"]

# Folders found private, by path: their (device, inode), so that a later check is one lstat.
_PRIVATE: dict[str, tuple[int, int]] = {}


def owner_name(uid: int) -> str:
    """The user ``uid`` as a person reads it: ``alice (uid 1001)``."""
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _me() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _open_to_others(path: str, info: os.stat_result, me: int) -> str | None:
    """Why another user can change the entries of the folder ``path`` (its ``lstat``), or None."""
    if info.st_uid not in (0, me):
        return f"{path} belongs to {owner_name(info.st_uid)}, who can replace what is in it"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"{path} can be written by other users and is not sticky (mode {stat.filemode(info.st_mode)})"
    return None


def _above_problem(folder: str, me: int) -> str | None:
    """Why another user could replace ``folder`` or a folder above it (both as written and with every
    link resolved), or None. Folders not made yet are skipped: they are made by this user."""
    for path in dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder))):
        parent = os.path.dirname(path)
        chain = []
        while True:
            chain.append(parent)
            up = os.path.dirname(parent)
            if up == parent:
                break
            parent = up
        for above in reversed(chain):
            try:
                info = os.lstat(above)
            except FileNotFoundError:
                break  # made below by this user (make_private), 0700
            if stat.S_ISLNK(info.st_mode):  # its target is checked by the resolved walk
                if info.st_uid not in (0, me):
                    return f"{above} is a symbolic link of {owner_name(info.st_uid)}'s"
                continue
            problem = _open_to_others(above, info, me)
            if problem is not None:
                return problem
    return None


def private_problem(folder: str) -> str | None:
    """Why the folder ``folder`` is not this user's alone (see the module's docstring), or None:
    it is, or it does not exist (nothing there can be read). A folder of this user's that others may
    only read (made by an older ckptools, mode 0755) is made 0700.

    Example: ``private_problem("/dev/shm/ckptools-alice-1a2b") is None``
    """
    me = _me()
    if me is None:  # no users to tell apart (Windows): nothing to check
        return None
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return None
    if _PRIVATE.get(folder) == (info.st_dev, info.st_ino) and _private(info, me):
        return None  # checked whole before; nobody else can have changed what is above it
    if stat.S_ISLNK(info.st_mode):
        return f"{folder} is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder"
    if info.st_uid != me:
        return f"{folder} belongs to {owner_name(info.st_uid)}, not to {owner_name(me)}"
    if info.st_mode & 0o022:
        return f"{folder} can be written by its group or other users (mode {stat.filemode(info.st_mode)})"
    problem = _above_problem(folder, me)
    if problem is not None:
        return problem
    if info.st_mode & 0o077:  # readable by others: snapshots are this user's data
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700, follow_symlinks=False)
    _PRIVATE[folder] = (info.st_dev, info.st_ino)
    return None


def _private(info: os.stat_result, me: int) -> bool:
    return stat.S_ISDIR(info.st_mode) and info.st_uid == me and not info.st_mode & 0o022


def make_private(folder: str) -> str | None:
    """Make ``folder`` this user's alone (mode 0700, created exclusively, with any folder above it that
    is missing), or check the one there; None when it is, else why not (`private_problem`): then it is
    left as it is, and must not be used.

    Example: ``make_private("/dev/shm/ckptools-alice-1a2b")`` is None
    """
    if _me() is None:
        os.makedirs(folder, exist_ok=True)
        return None
    problem = _above_problem(folder, _me() or 0)  # before anything is made under another user's folder
    if problem is not None:
        return problem
    missing = []
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        up = os.path.dirname(path)
        if up == path:
            break
        path = up
    for path in reversed(missing):  # each 0700 (os.makedirs would give the folders above the umask's mode)
        with contextlib.suppress(FileExistsError):  # made first by another: checked as found
            os.mkdir(path, 0o700)
    return private_problem(folder) or _above_problem(folder, _me() or 0)
