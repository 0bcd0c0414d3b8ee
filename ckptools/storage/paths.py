"""Where a file is: a path or URL resolved once into a `Location`, names, listings, temporary names
and which of them a writer that is gone left behind; and what is in flight in this process (a
background write of a path, which resolving that path waits for; the one async save, which every
checkpoint call finishes first).

A background writer (the Lightning async plugin's, an async save's) returns to its caller before the
file exists. Anything in this process that then resolves the same path through ckptools (a load by
another plugin instance, ``ck.load``, ``ckpt verify``, a removal, another save) waits for that write
first, so that it never sees the previous file, or none, where the caller already saved one.

    >>> handle = announce("/tmp/in-flight-example.pt")
    >>> handle.done()
    >>> wait_for("/tmp/in-flight-example.pt")  # nothing in flight: returns at once
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from typing import Protocol, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .processes import pid_alive

__all__ = [
    "STALE_TMP_SECONDS",
    "TMP_MARKER",
    "Location",
    "PathLike",
    "Write",
    "abandoned_tmps",
    "announce",
    "file_size",
    "finish_pending",
    "forget_pending",
    "fresh_tmp",
    "fspath",
    "fsync_dir",
    "get_filesystem",
    "host",
    "is_abandoned_tmp",
    "is_local",
    "is_object_store",
    "join",
    "list_files",
    "pending",
    "remove",
    "resolve",
    "set_pending",
    "tmp_name",
    "wait_for",
]  # fmt: skip

PathLike = Union[str, "os.PathLike[str]"]


# Temporary files start with "." and carry this marker, so that neither the manager's listing
# nor a user's glob for "*.pt" mistakes a crash leftover for a checkpoint.
TMP_MARKER = ".ckptools-tmp-"


class Location:
    """A path or URL resolved once: what was given, its filesystem, and the path inside it.

    Every function here takes a `Location` as readily as a string, and uses its filesystem
    instead of parsing the string again, the way httpx parses a URL once; ``str()`` and
    ``os.fspath()`` give back the path as the user wrote it, so messages name it unchanged.

    Examples:
        >>> loc = resolve("memory://ckpts/step-5.pt")
        >>> loc.url, loc.path, loc.local, loc.name
        ('memory://ckpts/step-5.pt', '/ckpts/step-5.pt', False, 'step-5.pt')
    """

    __slots__ = ("fs", "local", "own", "path", "url")

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, path: str, *, own: bool = False) -> None:
        self.url = url
        self.fs = fs
        self.path = path
        self.local = is_local(fs)
        # True: a local file here is read only if it is this user's own and no symbolic link (`as_own`).
        self.own = own

    def as_own(self) -> Location:
        """The same place, read only if the file is this user's own and no symbolic link (checked on
        the open descriptor): for files this user's job wrote itself, node memory's snapshots, where a
        link or another user's file can only be someone else's doing.

        Examples:
            >>> resolve("/dev/shm/ckptools-me-1a2b/ckpt-0000000005.pt").as_own().own
            True
        """
        return Location(self.url, self.fs, self.path, own=True)

    @property
    def name(self) -> str:
        """The last part of the path as written (a file's name, a folder's name; a `pinned` file's own)."""
        return os.path.basename(self.url.rstrip("/"))

    def child(self, name: str) -> Location:
        """``name`` inside this folder, on the same filesystem: nothing is parsed or resolved again.

        Examples:
            >>> resolve("memory://ckpts").child("step-5.pt").url
            'memory://ckpts/step-5.pt'
        """
        return Location(join(self.url, name), self.fs, self.path.rstrip("/") + "/" + name, own=self.own)

    @property
    def absolute(self) -> Location:
        """The same local place named by its absolute path (what messages about a folder's files
        name); a remote location as it is.

        Examples:
            >>> import os
            >>> resolve("ckpts").absolute.url == os.path.abspath("ckpts")
            True
        """
        return Location(self.path, self.fs, self.path, own=self.own) if self.local else self

    @property
    def parent(self) -> Location:
        """The folder this path is in (``"."`` for a bare local name), on the same filesystem.

        Examples:
            >>> resolve("memory://ckpts/model.safetensors.index.json").parent.path
            '/ckpts'
        """
        url = self.url.rstrip("/")
        return Location(url.rsplit("/", 1)[0] if "/" in url else ".", self.fs, os.path.dirname(self.path.rstrip("/")))

    def __fspath__(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"


def resolve(path: PathLike) -> Location:
    """Resolve a local path or an fsspec URL into a `Location`, once (a `Location` is returned as is).

    A path whose write is in flight in this process (`announce`) is resolved once that
    write ended: every operation on it sees the file its caller already saved.
    """
    if isinstance(path, Location):
        return path
    url = fspath(path)
    wait_for(url)  # a background write of this path in this process ends first
    fs, inner = fsspec.core.url_to_fs(url)
    return Location(url, fs, str(inner))


def fspath(path: PathLike) -> str:
    """``path`` as a non-empty ``str`` (an ``os.PathLike`` is converted; a URL stays as written)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"expected a non-empty path or URL string, got {path!r}")
    return path


def get_filesystem(path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path inside it)`` for a local path or any fsspec URL."""
    location = resolve(path)
    return location.fs, location.path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk, where rename and fsync give atomic, durable writes."""
    return isinstance(fs, LocalFileSystem)


def join(directory: PathLike, name: str) -> str:
    """Join a directory path or URL and a file name without mangling the URL."""
    directory = fspath(directory)
    return directory.rstrip("/") + "/" + name if "://" in directory else os.path.join(directory, name)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (fsync of the directory; skipped where refused)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (certain FUSE/NFS mounts) refuse fsync on a directory
    finally:
        os.close(fd)


# Object stores: one PUT (or one completed multipart upload) makes an object appear whole or
# not at all, and they have no rename; every other fsspec filesystem gets temp name + move.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos"})


def host() -> str:
    """This machine's name as temporary names carry it (`tmp_name`)."""
    # Only characters that survive in a file name on every filesystem and never split the name.
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def tmp_name(name: str) -> str:
    """A unique temporary name for ``name`` in the same directory.

    It names its writer (host and pid), so a later save can tell a dead writer's leftover from
    the file a live writer is still filling (see `is_abandoned_tmp`).
    """
    return f".{name}{TMP_MARKER}{host()}-{os.getpid()}-{secrets.token_hex(4)}"


def fresh_tmp(directory: str, name: str) -> str:
    """A new temporary path for ``name`` in the local ``directory`` (`tmp_name`), once every temporary
    file (or folder) of ``name`` whose writer on this host is gone is removed: a write killed midway
    leaves its temporary behind, and the next write of the same output takes it away. A live
    writer's is never touched (two writers of one output each keep their own).

    Examples:
        >>> import tempfile
        >>> os.path.basename(fresh_tmp(tempfile.gettempdir(), "step-5.pt")).startswith(".step-5.pt" + TMP_MARKER)
        True
    """
    mine = f".{name}{TMP_MARKER}{host()}-"
    try:
        with os.scandir(directory) as entries:
            found = [entry.name for entry in entries if entry.name.startswith(mine)]
    except OSError:
        found = []
    for leftover in found:
        pid = leftover[len(mine) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            path = os.path.join(directory, leftover)
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    return os.path.join(directory, tmp_name(name))


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool(_OBJECT_STORES.intersection(protocols))


def list_files(directory: PathLike) -> list[str]:
    """Names (not paths) of the files directly inside ``directory``; empty if it does not exist."""
    fs, fpath = get_filesystem(directory)
    if not is_local(fs):
        # s3fs and friends cache listings; another process (the job's other writer, a restarted
        # run) may have changed the directory since.
        fs.invalidate_cache(fpath)
    try:
        entries = fs.ls(fpath, detail=True)
    except FileNotFoundError:
        return []
    return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")


def file_size(path: PathLike) -> int:
    """Size in bytes of the file at ``path`` (a stat locally, one metadata request remotely)."""
    fs, fpath = get_filesystem(path)
    return os.path.getsize(fpath) if is_local(fs) else int(fs.size(fpath))


def remove(path: PathLike) -> None:
    """Delete one file (missing is fine: another process may have pruned it already)."""
    fs, fpath = get_filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(fpath)


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


# What is in flight in this process: writes by path (`announce`), and the one async save.

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


class _Waitable(Protocol):
    def wait(self) -> str: ...


_PENDING: list[_Waitable] = []  # the async save in flight, if any (`ckptools.write.AsyncSave`)


def pending() -> _Waitable | None:
    """The async save in flight (not yet waited for), or None."""
    return _PENDING[0] if _PENDING else None


def set_pending(handle: _Waitable) -> None:
    """Hold ``handle`` as the async save in flight (`forget_pending` once its wait ended)."""
    if _PENDING:
        raise RuntimeError("an async save is already in flight; finish_pending() first")
    _PENDING.append(handle)


def forget_pending(handle: _Waitable) -> None:
    """``handle``'s wait ended (written, failed or abandoned): it is no longer in flight."""
    if _PENDING and _PENDING[0] is handle:
        _PENDING.clear()


def finish_pending() -> str | None:
    """Collective: wait for the async save in flight, if any; its path (None if there was none).

    Every checkpoint call (save, async_save, load, the manager's) calls this first, so at most
    one save is ever in flight and a failed background write is raised on every rank at the
    next checkpoint call at the latest.
    """
    handle = pending()
    if handle is None:
        return None
    waited = time.monotonic()
    path = handle.wait()
    if time.monotonic() - waited > 1.0:
        waited = time.monotonic() - waited
        logging.getLogger("ckptools").debug("waited %.1f s for the background save of %s", waited, path)
    return path
