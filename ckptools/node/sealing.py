"""A snapshot copied but not yet committed, sealed after a kill: the step counts once its copy is whole.

A snapshot's commit (CRC-32s, then the rename; `ckptools.node.commits`) runs in the background
while training goes on, and takes about half the copy (four times with zlib). A kill -9 during it lost that
step as well as the one in progress: two steps, not one. So each node's slot being copied into
carries a record beside it (``<slot>.copies``): the snapshot's name, then one byte per local rank,
set by that rank once its copy is whole; the node's leader writes the zip's headers, small records
and central directory into the slot during its own copy (storages' CRC-32s as 0). A slot whose
every byte is set holds a whole snapshot but for its CRC-32s, and `seal` finishes it as the commit
would have: it computes each record's CRC-32 from the copy, writes them into the local headers and
the central directory, and renames the slot into place. The restore of a relaunch and the keeper
(which imports no torch: neither does this module) seal before they look for the newest snapshot.

Examples:
    >>> import re
    >>> seal("/dev/shm/ckptools-doc-absent", re.compile(r"ckpt-(\\d+)\\.pt"))  # nothing to seal there
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from collections.abc import Callable

from ..codecs.torchzip import TorchZip
from ..errors import CheckpointError
from ..storage import crc32, private_problem

__all__ = ["COPIES", "begin", "copied", "forget", "seal", "sealable"]

COPIES = ".copies"  # the suffix of a slot's record of its copies
_CENTRAL = 0x02014B50
_CHUNK = 64 << 20  # CRC-32s are computed in pieces this large (a view of the mapping each)


def begin(slot: str, name: str, ranks: int) -> None:
    """Node leader, before any rank copies into ``slot``: it now receives the snapshot ``name``
    from ``ranks`` local ranks, none done (a record left by an earlier use is replaced)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(slot + COPIES, flags, 0o600), "wb") as f:  # truncated first: no whole record if killed
        f.write(bytes(ranks) + name.encode("utf-8"))


def copied(slot: str, index: int) -> None:
    """The local rank ``index`` (0: the node's leader) finished its copy into ``slot``."""
    fd = os.open(slot + COPIES, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x01", index)
    finally:
        os.close(fd)


def forget(slot: str) -> None:
    """``slot`` was committed, removed or is about to be reused: its record goes."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(slot + COPIES)


def _record(slot: str, ranks_max: int = 4096) -> str | None:
    """The name of the snapshot every local rank copied into ``slot``, or None."""
    try:
        with open(slot + COPIES, "rb") as f:
            data = f.read(ranks_max + 4096)
    except FileNotFoundError:
        return None
    done = len(data) - len(data.lstrip(b"\x01"))
    if done == 0 or done == len(data) or data[done] == 0:  # a rank not done (or no name)
        return None
    return data[done:].decode("utf-8", errors="replace")


def seal(folder: str, names: re.Pattern[str], warn: Callable[[str], None] | None = None) -> str | None:
    """Node leader: seal the newest slot of ``folder`` that every local rank copied into but whose
    commit did not happen, when its step is newer than every committed snapshot there; its path, or None.
    ``names``: the snapshots' file names, the step in group 1 (`ckptools.node.names.checkpoint_names`).

    Records of slots that are gone are removed; a slot that cannot be sealed is said through ``warn``
    and left as it is (the committed snapshot before it stays the newest).
    """
    for _, slot, name in sealable(folder, names):
        target = os.path.join(folder, name)
        try:
            _fill_crcs(slot)
            os.rename(slot, target)
        except (CheckpointError, OSError, ValueError, struct.error) as err:
            # Sealed meanwhile by another (a relaunch's other local rank, or the keeper): the same bytes.
            if not (os.path.exists(target) and not os.path.exists(slot)):
                if warn is not None:
                    warn(f"the snapshot {name} in {folder} was copied whole but could not be sealed: {err}")
                continue
        forget(slot)
        return target
    return None


def sealable(folder: str, names: re.Pattern[str]) -> list[tuple[int, str, str]]:
    """``(step, slot, name)`` of each slot in ``folder`` that `seal` would seal, newest first: every
    local rank copied it whole, and its step is newer than every committed snapshot. Records of
    slots that are gone are removed."""
    if private_problem(folder) is not None:  # not this user's alone: nothing in it is sealed (its readers say why)
        return []
    try:
        listed = os.listdir(folder)
    except FileNotFoundError:
        return []
    committed = max((int(m.group(1)) for n in listed if (m := names.fullmatch(n))), default=-1)
    found = []
    for record in (n for n in listed if n.endswith(COPIES)):
        slot = os.path.join(folder, record[: -len(COPIES)])
        if not os.path.exists(slot):
            forget(slot)
            continue
        name = _record(slot)
        match = names.fullmatch(name or "")
        if name is not None and match is not None and int(match.group(1)) > committed:
            found.append((int(match.group(1)), slot, name))
    return sorted(found, reverse=True)


def _fill_crcs(slot: str) -> None:
    """Compute every record's CRC-32 from its data and write it into its local header and its
    central directory entry (the directory lists the records in the headers' order)."""
    archive = TorchZip(slot)  # the container as the leader wrote it: checked, as torch would check it
    with open(slot, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        crcs = []
        with memoryview(mapped) as view:  # released before the mapping closes
            for info, start in zip(archive.infos, archive.starts):
                crc = 0
                for at in range(start, start + info.file_size, _CHUNK):
                    crc = crc32(view[at : min(at + _CHUNK, start + info.file_size)], crc)
                crcs.append(crc)
        for info, crc in zip(archive.infos, crcs):
            struct.pack_into("<I", mapped, info.header_offset + 14, crc)
        at = archive.directory_at
        for crc in crcs:
            if struct.unpack_from("<I", mapped, at)[0] != _CENTRAL:
                raise CheckpointError(f"{slot}: its central directory is damaged")
            struct.pack_into("<I", mapped, at + 16, crc)
            n, m, k = struct.unpack_from("<3H", mapped, at + 28)
            at += 46 + n + m + k
        mapped.flush()
