"""Which temporary files a writer that is gone left behind.

Every temporary name (`ckptools.storage.tmp_name`) says its writer: host and pid. A save that finds
one of another save's temporaries removes it only when that writer is gone, so two jobs writing
into one directory never delete each other's files.
"""

from __future__ import annotations

import time

from .paths import TMP_MARKER, PathLike, fspath, get_filesystem, host, join, list_files
from .processes import pid_alive

# A temporary file whose writer cannot be checked (another host) is treated as abandoned only
# after this long without a change: a live writer touches its file continuously.
STALE_TMP_SECONDS = 3600.0


def _tmp_owner(name: str) -> tuple[str, int] | None:
    tail = name.rpartition(TMP_MARKER)[2]
    parts = tail.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def is_abandoned_tmp(path: PathLike) -> bool:
    """Whether the temporary file at ``path`` was left by a writer that is gone.

    True when its writer ran on this host and that process no longer exists, or when it has not
    changed for `STALE_TMP_SECONDS` (a writer on another host, whose pid means nothing
    here, or a pid since reused by another process). False while the writer may still be filling
    it, so a second job writing into the same directory never has its file deleted under it.
    """
    path = fspath(path)
    owner = _tmp_owner(path.rsplit("/", 1)[-1])
    if owner is not None and owner[0] == host() and not pid_alive(owner[1]):
        return True
    fs, fpath = get_filesystem(path)
    try:
        modified = fs.modified(fpath)
    except (OSError, NotImplementedError, ValueError):
        return False
    stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified)
    return time.time() - stamp > STALE_TMP_SECONDS


def abandoned_tmps(directory: PathLike, start: str) -> list[str]:
    """Paths of the temporary files in ``directory`` whose names begin with ``start`` and whose
    writer is gone (`is_abandoned_tmp`): what a kill mid-save left, never a live writer's file."""
    names = [name for name in list_files(directory) if name.startswith(start) and TMP_MARKER in name]
    return [path for path in (join(directory, name) for name in names) if is_abandoned_tmp(path)]
