"""Atomic writes: local (a temporary file, fsync, rename, directory fsync), S3 (a streamed multipart
upload completed last), other object stores (one PUT), other remote filesystems (temporary name, move);
and waiting for a watched write (`watch`, `run_watched`; a restore's reads are watched the same way): by how
far it came (`Stall`, `ckptools.storage.processes`), a stuck one is given up within a bound
(docs/guarantees.md, "Slow and stuck storage")."""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import IO, Any, Generic, TypeVar, cast

import fsspec

from ..errors import StorageStalledError
from .paths import PathLike, fresh_tmp, fspath, fsync_dir, get_filesystem, is_local, is_object_store, tmp_name
from .processes import abandon, moved, thread_io, watched, watched_fsync, write_progress

__all__ = [
    "CALLER",
    "STALL_ENV",
    "UPLOAD_PART",
    "InThread",
    "Stall",
    "atomic_write",
    "local_target",
    "publish",
    "run_watched",
    "stall_timeout",
    "streams_multipart",
    "watch",
]

STALL_ENV = "CKPTOOLS_STALL_TIMEOUT"
# Seconds a write may make no progress before every rank is told (StorageStalledError): a fifth of NCCL's
# watchdog (600 s) and a fifteenth of gloo's timeout (1,800 s), and 28x the longest a healthy write goes
# without progress at 1 MB/s (a 4 MiB pwrite: ckptools.write.zip_writer.PWRITE_BYTES).
DEFAULT_STALL = 120.0


def atomic_write(path: PathLike, write: Callable[[IO[bytes]], Any], *, streamable: bool = False) -> str:
    """Write a file so that readers see either the old file or the complete new one.

    Local disk: ``write`` streams into a temporary file in the *target* directory (a rename
    across filesystems, e.g. from $TMPDIR, is not atomic and fails), which is flushed, fsynced,
    renamed over ``path`` with ``os.replace`` and made durable with an fsync of the directory.
    Object stores have no rename. On S3, when ``streamable`` (``write`` only writes forward, as
    ``torch.save`` does), the payload streams into a multipart upload that is completed only
    once everything is written and aborted on any failure (memory: about two 32 MiB parts);
    otherwise, and on other object stores (gcs, azure, ...), the payload is built in memory and
    sent in one complete write (a single PUT is atomic). Other remote filesystems
    (``memory://``, sftp, hdfs, ...) get the payload under a temporary name in the target
    directory, then a move onto ``path`` (a rename where the filesystem has one), so a write
    that fails midway never leaves a partial file at ``path``.

    Args:
        path: destination path or URL.
        write: called once with a binary file object to write into.
        streamable: ``write`` never seeks (it may then stream into an S3 multipart upload).

    Returns:
        The path as a string.

    Raises:
        OSError: the write failed; the temporary file is removed and ``path`` is untouched.
    """
    fs, fpath = get_filesystem(path)
    path = fspath(path)
    if not is_local(fs):
        _remote_write(fs, fpath, write, streamable=streamable)
        return path
    directory, name = local_target(fpath)
    tmp = fresh_tmp(directory, name)  # a killed earlier write's temporary goes first
    try:
        with open(tmp, "wb") as f:
            recorder = _WriteRecorder(f)
            try:
                write(recorder)  # type: ignore[arg-type]  # a file in all but name
            except Exception as err:
                # torch's zip writer reports a failed write() as "unexpected pos 704 vs 598";
                # the OS error underneath ("File too large", "No space left") is the news.
                if recorder.error is not None and recorder.error is not err:
                    raise recorder.error from err
                raise
            f.flush()
            watched_fsync(f.fileno())
    except BaseException:
        # BaseException too: a KeyboardInterrupt mid-write must not leave a temp file behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    publish(tmp, directory, name)
    return path


def local_target(path: str) -> tuple[str, str]:
    """The directory a local write of ``path`` goes to (created if missing) and the file's name.

    Raises:
        NotADirectoryError: a file stands where the directory should be.
    """
    directory, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise NotADirectoryError(f"cannot write {path}: {directory} is not a directory")
        os.makedirs(directory, exist_ok=True)
    return directory, name


def publish(tmp: str, directory: str, name: str) -> None:
    """The commit of every local write: rename the complete, fsynced temporary file ``tmp`` over
    ``directory/name`` (atomic), then fsync the directory so that the rename survives a crash.
    The temporary file is removed if the rename fails."""
    try:
        moved()  # a write its waiter gave up on (stuck storage) is never published, even if it comes back
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


class _WriteRecorder:
    """A file wrapper that remembers the OSError of a failed ``write`` (see ``atomic_write``)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self._f.write(data)
        except OSError as err:
            self.error = err
            raise
        moved(written)  # a watched write's progress (and where a waiter gave up on it, its end)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# Parts of a streamed multipart upload: S3 allows 10,000 parts of at least 5 MiB, so 32 MiB parts
# reach 312 GiB (a larger object needs a larger part size); a writer holds about two parts at once.
UPLOAD_PART = 32 << 20


def streams_multipart(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether writes to ``fs`` go through a multipart upload that is completed only on close()
    and can be aborted with discard(), and whose parts any client may upload: S3 (s3fs)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def _stream_upload(fs: fsspec.AbstractFileSystem, fpath: str, write: Callable[[IO[bytes]], Any]) -> None:
    # torch.save writes front to back, so it streams into the upload: parts go out as they fill
    # and memory holds one or two parts, not a copy of the whole checkpoint. The upload is
    # completed only when everything was written: before that the object does not exist (a
    # reader sees the previous one), and on any failure it is aborted. A killed writer leaves an
    # incomplete upload, which S3 never shows as an object (a bucket lifecycle rule reaps those).
    f = fs.open(fpath, "wb", block_size=UPLOAD_PART)
    try:
        write(cast(IO[bytes], _PartSized(f)))  # write() is all torch.save calls
        f.close()  # completes the multipart upload (a small file goes as one PUT)
    except BaseException:
        with contextlib.suppress(Exception):
            f.discard()  # abort the multipart upload
        f.closed = True  # never commit later, from close() or the finaliser
        raise


class _PartSized:
    """Hands a file big writes in part-sized slices: torch writes a whole tensor record at once,
    which s3fs would buffer whole (and copy) before cutting it into parts."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), UPLOAD_PART):
            self._f.write(view[start : start + UPLOAD_PART])
            moved(min(UPLOAD_PART, len(view) - start))
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _remote_write(
    fs: fsspec.AbstractFileSystem, fpath: str, write: Callable[[IO[bytes]], Any], *, streamable: bool
) -> None:
    if streamable and streams_multipart(fs):
        _stream_upload(fs, fpath, write)
        return
    # Other stores: the payload is built in memory and sent in one complete write.
    buffer = io.BytesIO()
    write(buffer)
    data = buffer.getvalue()
    if is_object_store(fs):
        fs.pipe_file(fpath, data)
        return
    parent, _, name = fpath.rpartition("/")
    tmp = f"{parent}/{tmp_name(name)}" if parent else tmp_name(name)
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, fpath)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(tmp)
        raise


def stall_timeout() -> float:
    """Seconds a checkpoint write may make no progress before it is given up (``CKPTOOLS_STALL_TIMEOUT``,
    default 120; 0 or less: never, as before 0.5).

    Examples:
        >>> stall_timeout() > 0
        True
    """
    text = os.environ.get(STALL_ENV, "").strip()
    try:
        return float(text) if text else DEFAULT_STALL
    except ValueError:
        raise ValueError(f"{STALL_ENV}={text!r} is not a number of seconds (0 or less: no bound)") from None


def _draining() -> int | None:
    """The kernel's dirty and under-writeback bytes (/proc/meminfo), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            rows = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return sum(int(rows[key].split()[0]) for key in (b"Dirty", b"Writeback")) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


class Stall:
    """How long the I/O of ``thread`` (run `watched`) has not moved, as whoever looks sees it: one judgement
    for `watch` and for a save's look at the one before it (`ckptools.write.async_save.skip_behind`).
    Progress is bytes handed to or read from the storage (the thread's own counters, `thread_io`, and what a
    write reports, `moved`), a sync or rename that returned, and, while it is in a sync (the page cache's data
    going to the storage), the kernel's dirty bytes going down since the last look. A read whose thread's
    counters cannot be read (no /proc) is never judged idle.

    Examples:
        >>> Stall(threading.current_thread()).look() is None  # not a watched write
        True
    """

    def __init__(self, thread: threading.Thread, *, reading: bool = False) -> None:
        self.thread, self.reading = thread, reading
        now = time.monotonic()
        self._dirty, self._drained = _draining(), now
        self._counted: int | None = None
        self._counted_at = now

    def look(self) -> tuple[float, tuple[float, float, int, bool]] | None:
        """``(seconds without progress, write_progress)`` now; None while the thread runs nothing watched."""
        seen = None if self.thread.ident is None else write_progress(self.thread.ident)
        if seen is None:
            return None
        now = time.monotonic()
        dirty = _draining()
        if self._dirty is not None and dirty is not None and dirty < self._dirty:
            self._drained = now
        self._dirty = dirty
        counted = None if self.thread.native_id is None else thread_io(self.thread.native_id)
        if counted is not None and counted != self._counted:
            self._counted, self._counted_at = counted, now
        elif counted is None and self.reading:  # a read reports nothing of its own: unseen, it is not judged
            self._counted_at = now
        idle = min(seen[1], now - self._counted_at)
        return (min(idle, now - self._drained) if seen[3] else idle), seen


def watch(
    thread: threading.Thread, target: str, *, reading: bool = False, stall: Stall | None = None
) -> StorageStalledError | None:
    """Join ``thread``, a writer (or, ``reading``, a reader) that runs its I/O `watched`; if it makes no
    progress (`Stall`; ``stall``: the one earlier looks kept) for `stall_timeout` seconds, give it up (a
    writer stops at its next step and publishes nothing; a reader's result is dropped) and return the error
    every rank raises. None once the thread ended.
    """
    bound = stall_timeout()
    if bound <= 0 or thread.ident is None:
        thread.join()
        return None
    stall = Stall(thread, reading=reading) if stall is None else stall
    while True:
        thread.join(min(1.0, bound / 4))
        if not thread.is_alive():
            return None
        looked = stall.look()
        if looked is not None and looked[0] > bound:
            idle, (elapsed, _, nbytes, _) = looked
            abandon(thread.ident)
            return _stalled(target, idle, bound, elapsed, nbytes, reading)


def _stalled(target: str, idle: float, bound: float, elapsed: float, nbytes: int, reading: bool) -> StorageStalledError:
    fix = f"check the mount, or raise {STALL_ENV} for a storage this slow"
    if reading:
        return StorageStalledError(
            f"the read of {target} made no progress for {idle:.0f} s ({STALL_ENV}={bound:g}) after {elapsed:.0f} s: "
            f"its storage is stuck or gone. Nothing was restored from it; {fix}"
        )
    rate = f" ({nbytes / elapsed / 1e6:.3g} MB/s)" if elapsed > 0 else ""
    return StorageStalledError(
        f"the write of {target} made no progress for {idle:.0f} s ({STALL_ENV}={bound:g}): "
        f"{nbytes / 1e6:.3g} MB written in {elapsed:.0f} s{rate}, then nothing; its storage is stuck or "
        f"gone. Nothing of this save was published (older checkpoints are untouched); {fix}"
    )


T = TypeVar("T")
# In a `run_watched` thread: the frame that called it, where a warning the thread raises is said to come from
# (`ckptools.log.warn`: the thread's own stack ends in threading's bootstrap, not in the user's code).
CALLER: contextvars.ContextVar[FrameType | None] = contextvars.ContextVar("ckptools_caller", default=None)


class InThread(Generic[T]):
    """``work`` running in a thread of its own, started at once (a daemon unless ``daemon=False``): `thread`,
    and once it ended `result`, what ``work`` returned (or raises what it raised) in the caller's thread.

    Examples:
        >>> job = InThread(lambda: 42, "ckptools-doc")
        >>> job.thread.join(); job.result()
        42
    """

    def __init__(self, work: Callable[[], T], name: str, *, daemon: bool = True) -> None:
        self._done: list[T] = []
        self._failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=daemon)
        self.thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._done.append(work())
        except BaseException as err:  # noqa: BLE001 - raised by result(), in the caller's thread
            self._failed.append(err)

    def result(self) -> T:
        """What ``work`` returned; raises what it raised (call once the thread ended)."""
        if self._failed:
            raise self._failed[0]
        return self._done[0]


def run_watched(work: Callable[[], T], target: str, *, name: str = "ckptools-save", reading: bool = False) -> T:
    """Run ``work`` (file I/O only: never a collective) in a thread of its own that this one watches: what it
    returns or raises, or `StorageStalledError` once it made no progress for `stall_timeout` seconds (it is
    given up: it stops at its next step and publishes nothing). ``reading``: ``work`` reads ``target`` (the
    error says so). It runs in a copy of this thread's context (a progress hook goes on being called).

    Examples:
        >>> run_watched(lambda: 42, "/tmp/a.pt")
        42
    """
    context = contextvars.copy_context()
    context.run(CALLER.set, sys._getframe(1))  # a warning raised in the thread names the caller's line

    def watched_work() -> T:
        with watched():
            return context.run(work)

    # A daemon: given up on, it may stay inside the storage until it answers; the process must still end.
    job = InThread(watched_work, name)
    stalled = watch(job.thread, target, reading=reading)
    if stalled is not None:
        raise stalled
    return job.result()
