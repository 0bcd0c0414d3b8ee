"""The slots: each node keeps two slot files, mapped once into every local rank and reused.

The newest committed snapshot and a spare under a temporary name: a snapshot copies into the
spare (a CUDA tensor device-to-host, into the mapping registered with CUDA as pinned memory) and
its commit renames it into place; the one it replaces becomes the spare. The slot file is
preallocated (``posix_fallocate``) before the copy, so a node memory too small for it is a
`NodeMemoryError` before anything is written, never a SIGBUS in the middle of the copy (what a
mapping of a tmpfs that runs out of pages does). `NodeSlots` holds a folder's mappings and spare: a
`ckptools.write.Stager`, as the async save's host buffers are.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from .. import log
from ..errors import CheckpointError, NodeMemoryError
from ..storage import tmp_name
from ..text import human_size
from ..write import copy_bytes, whole_storage
from . import sealing
from .folder import FIXES, check_space, note_pages
from .names import checkpoint_names

__all__ = ["MappedSlot", "NodeSlots", "release_all"]

SLOT = "snapshot-slot"  # the spare slot's name, under a temporary name of its writer
# How many mappings a rank keeps (two slots, and one to spare while a slot is replaced).
MAPPED_MAX = 3


class MappedSlot:
    """One slot file mapped into this process (and, for CUDA copies, registered as pinned)."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            if stat.st_size != size:
                raise CheckpointError(f"the snapshot slot {path} holds {stat.st_size} bytes, not {size}")
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where shmem allows them: fewer TLB misses
            with contextlib.suppress(OSError):
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.key = (stat.st_dev, stat.st_ino, size)
        self.folder = os.path.dirname(path)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.registered = False

    def pin(self) -> None:
        """Register the mapping with CUDA once, so device-to-host copies into it run at full speed;
        when that fails the copies still work, at pageable memory's speed."""
        if self.registered:
            return
        try:
            # What torch's own helper does (torch.cuda._pin_memory_utils, used by DCP, private and
            # not in every release we support): cudaHostRegisterPortable (1), pinned for every device.
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            code = int(cudart.cudaHostRegister(self.bytes.data_ptr(), self.bytes.numel(), 1))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister returned cudaError {code}")
            self.registered = True
        except Exception as err:  # noqa: BLE001 - a slower copy, not a failure
            log.warn(f"could not register the snapshot slot with CUDA ({err}): its copies run unpinned", once="pin")

    def close(self) -> None:
        if self.registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())  # type: ignore[no-untyped-call]
        del self.bytes
        with contextlib.suppress(BufferError):  # a view still alive keeps the mapping: it goes with it
            self.mm.close()


class NodeSlots:
    """A node-memory folder's slots in this process, and a `ckptools.write.Stager`: a snapshot's copy
    goes into the slot `open` mapped (`stage`, then `wait`), and `release` lets them all go. It holds its
    mappings (reused while a file and size stay), the folder's spare slot, and the slot files it made
    (only those are reused: a file restored from may still back tensors the caller holds). Held by the
    folder's `ckptools.node.NodeMemory`; `release_all` at the job's normal end.
    """

    def __init__(self, folder: str, prefix: str) -> None:
        self.folder, self.prefix = folder, prefix
        self.mapped: OrderedDict[tuple[int, int, int], MappedSlot] = OrderedDict()
        self.spare: str | None = None
        self.ours: set[tuple[int, int]] = set()
        self._target: MappedSlot | None = None
        self._devices: set[torch.device] = set()
        _LIVE.add(self)

    def open(self, path: str, size: int) -> MappedSlot:
        """``path`` mapped at ``size`` bytes, the slot `stage` copies into; reused while the file (its
        inode) and size are the same."""
        stat = os.stat(path)
        key = (stat.st_dev, stat.st_ino, size)
        mapped = self.mapped.get(key)
        if mapped is None:
            for other in [k for k in self.mapped if k[:2] == key[:2]]:  # resized: the old mapping overhangs the file
                self.mapped.pop(other).close()
            mapped = self.mapped[key] = MappedSlot(path, size)
            while len(self.mapped) > MAPPED_MAX:
                self.mapped.popitem(last=False)[1].close()
        self.mapped.move_to_end(key)
        self._target = mapped
        return mapped

    def stage(self, source: Any) -> Any:
        """Copy ``source`` (this rank's ``(share, storage or tensor)`` pairs) into the slot `open`
        mapped, each at its offset; CUDA copies are issued back to back, non-blocking (`wait`). The slot."""
        mapped = self._target
        assert mapped is not None  # open() comes first: the protocol's order
        for share, storage in source:
            data = storage if isinstance(storage, torch.Tensor) else whole_storage(storage)
            target = mapped.bytes[share.offset : share.offset + share.nbytes]
            if data.device.type == "cuda":
                mapped.pin()
                self._devices.add(data.device)
                copy_bytes(target, data, non_blocking=mapped.registered)
            else:
                copy_bytes(target, data)
        return mapped

    def wait(self) -> None:
        for device in self._devices:  # one synchronize per device waits for every copy issued on it
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()

    def keep_spare(self, path: str) -> None:
        """``path`` (allocated, not committed) stays the folder's spare: the next snapshot reuses it."""
        self.spare = path

    def prepare(self, size: int) -> str:
        """Leader: the slot to copy into, ``size`` bytes, its pages allocated; the newest committed
        snapshot stays whole, older ones go."""
        folder, names = self.folder, checkpoint_names(self.prefix)
        committed = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if names.fullmatch(n)]
        for old in committed[:-1]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
        newest = committed[-1] if committed else None
        spare, self.spare = self.spare, None
        if spare is not None and not os.path.isfile(spare):
            spare = None
        note_pages(folder)  # its restores' speed, said once
        try:
            check_space(folder, size, _allocated(newest) + _allocated(spare))
        except BaseException:
            self.spare = spare  # still the folder's spare: a later, smaller state reuses it
            raise
        path = spare or os.path.join(folder, tmp_name(f"{self.prefix}-{SLOT}"))
        sealing.forget(path)  # what it held is overwritten now: never sealed again
        _allocate(path, size, folder)
        self.ours.add(_inode(path))
        return path

    def recycle(self, kept: str) -> None:
        """Leader, after a commit: every other committed snapshot goes; one of this process's own
        slot files becomes the spare (renamed to a temporary name), the rest are removed."""
        names = checkpoint_names(self.prefix)
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if path == kept or not names.fullmatch(name):
                continue
            with contextlib.suppress(FileNotFoundError):
                if self.spare is None and _inode(path) in self.ours:
                    spare = os.path.join(self.folder, tmp_name(f"{self.prefix}-{SLOT}"))
                    os.rename(path, spare)
                    self.spare = spare
                else:
                    os.unlink(path)

    def release(self) -> int:
        """Unmap the slots and remove the spare (the committed snapshot stays); the bytes mapped."""
        held = sum(key[2] for key in self.mapped)
        spare = self.unmap()
        if spare is not None:
            sealing.forget(spare)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spare)
        return held

    def unmap(self) -> str | None:
        """Unmap every slot and forget the spare (left where it is); the spare's path."""
        while self.mapped:
            self.mapped.popitem()[1].close()
        self._target = None
        spare, self.spare = self.spare, None
        return spare


# Every NodeSlots of this process, for the job's normal end (`release_all`).
_LIVE: weakref.WeakSet[NodeSlots] = weakref.WeakSet()


def release_all() -> None:
    """Unmap every slot of this process and forget every spare (their folders go next: the job's
    normal end)."""
    for slots in list(_LIVE):
        slots.unmap()
        slots.ours.clear()


def _allocate(path: str, size: int, folder: str) -> None:
    """Make ``path`` ``size`` bytes with its pages allocated (removed again on failure)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            if os.fstat(fd).st_blocks * 512 < size:  # a reused slot has its pages: walking them costs ~35 ms/GiB
                os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise NodeMemoryError(
                    f"the node-memory folder {folder} ran out of space for a {human_size(size)} snapshot slot: {FIXES}"
                ) from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)


def _inode(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return (stat.st_dev, stat.st_ino)


def _allocated(path: str | None) -> int:
    if path is None:
        return 0
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
