"""Processes of this host: whether one still runs, when it started, whether it is this user's; and of this
process's background threads (a write, a snapshot's commit) the priority they run at and how far each write
came, by which whoever waits for it tells a slow storage from a stuck one (`ckptools.storage.watch`).

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
import time
from typing import Any

__all__ = [
    "BACKGROUND_NICENESS",
    "WriteAbandoned",
    "abandon",
    "moved",
    "pid_alive",
    "process_of_mine",
    "process_start",
    "thread_io",
    "watched",
    "watched_fsync",
    "write_progress",
    "yield_to_the_step",
]


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


# How far each watched write has come, by the thread that writes it: whoever waits for the write tells a
# slow storage (it moves) from a stuck one (it does not) by it (`watch`).
_LOCK = threading.Lock()
_MOVED: dict[int, list[float]] = {}  # writer thread -> [started, last moved (time.monotonic()), bytes, in a sync]
_ABANDONED: set[int] = set()  # writer threads whose waiter gave up: each stops at its next step


class WriteAbandoned(OSError):
    """Raised in a writer thread at its next step once its waiter gave up on it (the storage was stuck):
    the write stops there, and its temporary file goes as after any failed write."""


@contextlib.contextmanager
def watched() -> Any:
    """The writer thread's block: while it runs, its write's progress is kept (`moved`, `write_progress`)."""
    writer, now = threading.get_ident(), time.monotonic()
    with _LOCK:
        _MOVED[writer] = [now, now, 0.0, 0.0]
        _ABANDONED.discard(writer)
    try:
        yield
    finally:
        with _LOCK:  # a thread's id may be reused by a later thread: nothing of this one stays
            _MOVED.pop(writer, None)
            _ABANDONED.discard(writer)


def moved(nbytes: int = 0, *, writer: int | None = None, syncing: bool = False) -> None:
    """The write in this thread (or ``writer``) moved: ``nbytes`` more reached the storage, or a sync or a
    rename returned; ``syncing``: a sync (fsync) begins, whose progress is the page cache's draining.
    Raises `WriteAbandoned` when its waiter gave up on it: nothing more is written.

    Examples:
        >>> moved(4096)  # a write nobody watches: nothing kept
    """
    me = threading.get_ident() if writer is None else writer
    with _LOCK:
        entry = _MOVED.get(me)
        if entry is not None:
            entry[1] = time.monotonic()
            entry[2] += nbytes
            entry[3] = float(syncing)
        if me in _ABANDONED:
            _ABANDONED.discard(me)
            raise WriteAbandoned(f"the write (or read) was given up on: its storage made no progress (thread {me})")


def watched_fsync(fd: int, *, writer: int | None = None) -> None:
    """``os.fsync(fd)`` as a watched write's progress (`moved`): its start (the page cache's draining is its
    progress meanwhile) and its end; ``writer``: the thread whose write it is, when another thread syncs.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     watched_fsync(f.fileno())
    """
    moved(writer=writer, syncing=True)
    os.fsync(fd)
    moved(writer=writer)


def write_progress(writer: int) -> tuple[float, float, int, bool] | None:
    """``(seconds since it started, seconds since it last moved, bytes so far, whether it is in a sync)`` of
    the write in thread ``writer``, while it runs `watched`; None otherwise."""
    with _LOCK:
        entry = list(_MOVED.get(writer) or ())
    if not entry:
        return None
    now = time.monotonic()
    return now - entry[0], now - entry[1], int(entry[2]), bool(entry[3])


def abandon(writer: int) -> None:
    """Give up on the write in thread ``writer``: it raises `WriteAbandoned` at its next step."""
    with _LOCK:
        if writer in _MOVED:
            _ABANDONED.add(writer)


def thread_io(native_id: int) -> int | None:
    """How far the thread ``native_id`` of this process came with its I/O, as a number that grows while it
    moves: bytes its system calls read and wrote, plus its page faults (a load or a check of a mapped file
    reads by faulting, with no call of ours between: major faults read from storage, minor ones map pages
    the page cache or node memory holds). None where /proc cannot tell (not Linux, the thread gone).

    Examples:
        >>> thread_io(threading.get_native_id()) is None or thread_io(threading.get_native_id()) >= 0
        True
    """
    task = f"/proc/self/task/{native_id}"
    try:
        with open(f"{task}/io", "rb") as f:
            rows = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        with open(f"{task}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # proc(5), counted from the state (field 3)
        faults = int(fields[7]) + int(fields[9])  # minflt (field 10), majflt (field 12)
        return int(rows[b"rchar"]) + int(rows[b"wchar"]) + faults * 4096
    except (OSError, KeyError, ValueError, IndexError):
        return None
