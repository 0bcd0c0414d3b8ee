"""Writes in flight in this process, by path: whoever touches the path next waits for the write to end.

A background writer (the Lightning async plugin's) returns to its caller before the file exists.
Anything in this process that then resolves the same path through ckptools (a load by another
plugin instance, ``ck.load``, ``ckpt verify``, a removal, another save) waits for that write
first, so that it never sees the previous file, or none, where the caller already saved one.

    >>> handle = announce("/tmp/in-flight-example.pt")
    >>> handle.done()
    >>> wait_for("/tmp/in-flight-example.pt")  # nothing in flight: returns at once
"""

from __future__ import annotations

import os
import threading

__all__ = ["Write", "announce", "wait_for"]

_LOCK = threading.Lock()
_WRITES: dict[str, Write] = {}


class Write:
    """One announced write: `done` when it ended (written or failed). The thread that does the
    write calls `doing` first, so that its own later look-ups of the path do not wait for itself."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.writer: int | None = None
        self._ended = threading.Event()

    def doing(self) -> None:
        """Mark the calling thread as this write's writer."""
        self.writer = threading.get_ident()

    def done(self) -> None:
        """The write ended: release every waiter and forget it."""
        self._ended.set()
        with _LOCK:
            if _WRITES.get(self.key) is self:
                del _WRITES[self.key]

    def wait(self) -> None:
        self._ended.wait()


def _key(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def announce(path: str) -> Write:
    """Register a write of ``path`` that will end later (`Write.done`); replaces an earlier one."""
    write = Write(_key(path))
    with _LOCK:
        _WRITES[write.key] = write
    return write


def wait_for(path: str) -> None:
    """Block while a write of ``path`` announced in this process is in flight (not in its own writer)."""
    with _LOCK:
        write = _WRITES.get(_key(path))
    if write is not None and write.writer != threading.get_ident():
        write.wait()
