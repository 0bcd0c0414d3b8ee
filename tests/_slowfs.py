"""A storage that is slow or stuck, for tests: a passthrough FUSE filesystem whose writes can be throttled to a
bandwidth or frozen (every write and fsync blocks until thawed), and whose reads can be frozen alone (every
read of a file's data blocks until thawed: a stuck mount a restore meets), one mount per fixture, so that one
rank's storage can be slow while another's is not.

The filesystem runs in a process of its own (``python tests/_slowfs.py BACKING MOUNT CONTROL``, mfusepy on
Debian's libfuse3) and reads what to do from the JSON file CONTROL (``{"rate": bytes/s, "frozen": bool,
"reads_frozen": bool}``) whenever that file changes. `slow_storage` mounts it for a test and always thaws and
unmounts it, also when the test fails; the filesystem's process dies with the test process that started it
(PR_SET_PDEATHSIG), so a killed test leaves at most an unconnected mount point in its temporary folder. Where
FUSE cannot be used (no /dev/fuse, no fusermount3, no mfusepy, not allowed to mount), the tests skip with the
reason: `make venv` installs fuse3 where it may (`make fuse`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def why_not() -> str | None:
    """Why this machine cannot mount the filesystem, or None."""
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "needs /dev/fuse (read and write)"
    if shutil.which("fusermount3") is None:
        return "needs fusermount3 (Debian's fuse3: make fuse)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as err:  # OSError: mfusepy found no libfuse
        return f"needs mfusepy and libfuse3 ({err})"
    return None


def set_control(control: Path | str, **changes: Any) -> None:
    """Change a mount's behaviour through its CONTROL file (``rate=``, ``frozen=``, ``reads_frozen=``), from
    any process: a rank freezes the storage at the moment its scenario needs (`SlowMount.control` is the file)."""
    control = Path(control)
    current = json.loads(control.read_text()) if control.exists() else {}
    current.update(changes)
    tmp = control.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(current))
    os.replace(tmp, control)


class SlowMount:
    """One mount of the filesystem: ``path`` is where to write; `throttle`, `freeze`, `thaw` change it now."""

    def __init__(self, root: Path, backing: Path | None = None) -> None:
        self.backing = root / "backing" if backing is None else backing
        self.path, self.control = root / "mount", root / "control.json"
        self.backing.mkdir(parents=True, exist_ok=backing is not None)
        self.path.mkdir(parents=True)
        self._set(rate=0.0, frozen=False, reads_frozen=False)
        self._proc: subprocess.Popen[bytes] | None = None

    def _set(self, **changes: Any) -> None:
        set_control(self.control, **changes)

    def throttle(self, bytes_per_second: float) -> None:
        """Every write from now on takes its length / ``bytes_per_second`` (0: no limit)."""
        self._set(rate=float(bytes_per_second))

    def freeze(self) -> None:
        """Every write and fsync from now on blocks until `thaw` (reads and listings go on)."""
        self._set(frozen=True)

    def thaw(self) -> None:
        self._set(frozen=False, reads_frozen=False)

    def freeze_reads(self) -> None:
        """Every read of a file's data from now on blocks until `thaw` (writes, listings and stat go on)."""
        self._set(reads_frozen=True)

    def start(self) -> None:
        log = open(self.control.with_suffix(".log"), "wb")  # noqa: SIM115 - the filesystem's own output
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(self.backing), str(self.path), str(self.control)],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while not os.path.ismount(self.path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                output = self.control.with_suffix(".log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the FUSE filesystem did not mount at {self.path}: {output}")
            time.sleep(0.05)

    def close(self) -> None:
        """Thaw, unmount (lazily when busy) and end the filesystem's process."""
        with contextlib.suppress(OSError):
            self.thaw()
        if os.path.ismount(self.path):
            done = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True)
            if done.returncode != 0:
                subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


@contextlib.contextmanager
def slow_mount(root: Path, backing: Path | None = None) -> Iterator[SlowMount]:
    """A `SlowMount` under ``root``, mounted for the block and always thawed and unmounted after it; over
    ``backing`` when given (two mounts of one directory: one shared filesystem seen by two nodes' clients,
    each slowed or frozen alone)."""
    mount = SlowMount(root, backing)
    try:
        mount.start()
        yield mount
    finally:
        mount.close()


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _filesystem(backing: str, control: str) -> Any:
    import mfusepy as fuse

    class Passthrough(fuse.Operations):  # type: ignore[misc]
        use_ns = True

        def __init__(self) -> None:
            self.root = os.path.realpath(backing)
            self.rate, self.frozen, self.reads_frozen, self._seen = 0.0, False, False, 0.0
            self._lock = threading.Lock()

        def _p(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _read_control(self) -> None:
            with self._lock:
                try:
                    stamp = os.stat(control).st_mtime_ns
                    if stamp != self._seen:
                        with open(control) as f:
                            wanted = json.load(f)
                        self.rate, self.frozen, self._seen = float(wanted["rate"]), bool(wanted["frozen"]), stamp
                        self.reads_frozen = bool(wanted.get("reads_frozen", False))
                except (OSError, ValueError, KeyError):
                    pass

        def _wait_thawed(self, reading: bool = False) -> None:
            self._read_control()
            while self.reads_frozen if reading else self.frozen:
                time.sleep(0.02)
                self._read_control()

        def access(self, path: str, mode: int) -> None:
            if not os.access(self._p(path), mode):
                raise fuse.FuseOSError(errno.EACCES)

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(self._p(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> None:
            os.chown(self._p(path), uid, gid)

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            st = os.lstat(self._p(path))
            keys = ("st_atime_ns", "st_ctime_ns", "st_gid", "st_mode", "st_mtime_ns", "st_nlink", "st_size", "st_uid")
            return {k: getattr(st, k) for k in keys}

        def readdir(self, path: str, fh: Any) -> list[str]:
            return [".", "..", *os.listdir(self._p(path))]

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(self._p(path), mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(self._p(path))

        def unlink(self, path: str) -> None:
            os.unlink(self._p(path))

        def rename(self, old: str, new: str, *flags: Any) -> None:
            os.rename(self._p(old), self._p(new))

        def link(self, target: str, source: str) -> None:
            os.link(self._p(source), self._p(target))

        def symlink(self, target: str, source: str) -> None:
            os.symlink(source, self._p(target))

        def readlink(self, path: str) -> str:
            return os.readlink(self._p(path))

        def statfs(self, path: str) -> dict[str, Any]:
            s = os.statvfs(self._p(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                    "f_frsize", "f_namemax")  # fmt: skip
            return {k: getattr(s, k) for k in keys}

        def utimens(self, path: str, times: Any = None) -> None:
            os.utime(self._p(path), ns=times)

        def open(self, path: str, flags: int) -> int:
            return os.open(self._p(path), flags)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            self._wait_thawed(reading=True)
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            self._wait_thawed()
            if self.rate:
                time.sleep(len(data) / self.rate)
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            os.truncate(self._p(path), length)

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            self._wait_thawed()
            os.fsync(fh)

        def fsyncdir(self, path: str, datasync: int, fh: Any) -> None:
            self._wait_thawed()
            fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    return Passthrough()


if __name__ == "__main__":
    import mfusepy

    backing_dir, mount_point, control_file = sys.argv[1:4]
    mfusepy.FUSE(_filesystem(backing_dir, control_file), mount_point, foreground=True, nothreads=False)
