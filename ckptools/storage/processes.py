"""Processes of this host: whether one still runs, when it started, whether it is this user's; and the
priority a background thread of this one (a write, a snapshot's commit) runs at.

Imports nothing of ckptools': the storage door (a dead writer's temporary file), the keeper (the job it
watches) and the arrival check all ask it.

Examples:
    >>> import os
    >>> pid_alive(os.getpid()), process_of_mine(os.getpid(), process_start(os.getpid()))
    (True, True)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["BACKGROUND_NICENESS", "pid_alive", "process_of_mine", "process_start", "yield_to_the_step"]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (perhaps under another user); a zombie (exited,
    not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # it exists, under another user
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):  # not Linux, or gone meanwhile: what kill said
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, from ``/proc``): with its pid, what names
    one process, as a pid alone does not once the system gives it to another. None where there is
    no ``/proc`` (or no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_of_mine(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` runs on this host under this user (and, given ``started``, is the one
    that started then: `process_start`). A process of another user never counts: it proves nothing
    of this user's job. Where there is no ``/proc``, what ``kill(pid, 0)`` says."""
    if not pid_alive(pid):
        return False
    me = os.geteuid() if hasattr(os, "geteuid") else None
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:  # not Linux: kill(pid, 0) answered, and refuses another user's process unless root
        try:
            os.kill(pid, 0)
        except PermissionError:
            return False
        except OSError:
            return False
        return True
    if me is not None and owner != me:
        return False
    return started is None or process_start(pid) == started


# How much nicer than the process a background write runs (Linux: per thread): the step first.
BACKGROUND_NICENESS = 10


def yield_to_the_step(niceness: int = BACKGROUND_NICENESS) -> None:
    """Lower the calling thread's CPU priority by ``niceness`` (Linux: per thread; elsewhere nothing): where the
    training step keeps every core busy, a background write or commit runs in its gaps instead of taking a core
    from it (docs/benchmarks.md). Its copies into the page cache and its CRC-32s run on this thread; the disk's
    own writeback does not, so a write that waits longer loses nothing but time to durable.

    Examples:
        >>> yield_to_the_step(0)  # a thread's own niceness may always be raised
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # raising one's own niceness is always allowed; a sandbox may say no
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + niceness))
