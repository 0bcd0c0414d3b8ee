"""A restore that reads each byte of the file once between the ranks: ``ck.load(..., read="once")``.

Every rank maps the file (a local torch zip on a filesystem the ranks share: ``data.pkl`` is read,
no storage; an object in S3 or another store with ranged reads: a local stand-in of it,
`ckptools.read.remote_zip`), reads about 1/N of the storages' bytes (its own, the largest first to the
rank with the fewest; ``pread`` from a file, ranged GETs from an object), and receives every other
storage from the rank that read it over the process group. With ``verify`` each rank checks the
CRC-32 of the records it read (rank 0 those no tensor holds). Bytes read from storage: 1.0x the
file, at any world size (an object: plus its directory and small records, read by every rank). Why
and when: docs/guides/node-local-disks.md.

Examples:
    >>> plan_reads([40, 10, 30, 20], 2)  # the bytes each rank reads
    [50, 50]
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import log
from ..collective.agree import Agreement
from ..collective.group import all_gather_object, get_rank, get_world_size, local_world_size
from ..collective.tree import Skeleton, pieces_of, share_pieces
from ..errors import CheckpointFormatError
from ..layouts import check_records, damaged_record, zip_records
from ..storage import Location, crc32, pinned
from .remote_zip import RemoteZip, Unranged, reads_in_ranges

__all__ = ["ReadAnotherWay", "once_pays", "plan_reads", "read_once"]


class ReadAnotherWay(Exception):
    """Raised on every rank alike when the file cannot be read once between the ranks: ``how``
    (``"rank0"``: rank 0 reads and sends, a remote or legacy file; ``"each"``: each rank reads its own)."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


def once_pays(location: Location, world: int) -> bool:
    """``read="auto"``'s rule for ``world`` ranks (more than one): read once where the ranks span
    several nodes and share the file's filesystem (one node's ranks share its page cache), and from
    an object store with ranged reads (each rank's GETs are its share of the bytes, not all of them).

    Examples:
        >>> from ckptools.storage import resolve
        >>> once_pays(resolve("s3://bucket/ckpt.pt"), 8), once_pays(resolve("/tmp/ckpt.pt"), 1)
        (True, False)
    """
    return (world > local_world_size(world) and location.local) or reads_in_ranges(location)


def plan_reads(sizes: list[int], world: int) -> list[int]:
    """The bytes each of ``world`` ranks reads of storages of ``sizes`` (see `pieces_of`)."""
    return [sum(length for _, _, length, owner in pieces_of(sizes, world) if owner == rank) for rank in range(world)]


def read_once(location: Location, device: torch.device, read: Callable[[Location], Any], *, verify: bool) -> Any:
    """Collective: the tree ``read(location)`` gives (torch's load of the mapped file, on the CPU),
    its storages read once between the ranks, on ``device``. `ReadAnotherWay` on every rank when the
    file cannot be read so (remote without ranged reads, legacy, or not the same file on every rank).

    ``read`` must map the file it is given (nothing but ``data.pkl`` read; an object's stand-in). A
    rank that cannot (a file only some nodes have) makes every rank read its own (``"each"``), where
    the error says what to do.
    """
    error: BaseException | None = None
    parts: Skeleton | None = None
    records: dict[int, tuple[str, int, int]] | None = None
    remote: RemoteZip | None = None
    with contextlib.ExitStack() as stack:
        try:
            if reads_in_ranges(location):  # an object store: its stand-in is mapped (ckptools.read.remote_zip)
                with contextlib.suppress(Unranged):  # records is None: rank 0 reads it
                    remote = RemoteZip(location, verify=verify)
                    with remote.stand_in() as stand_in:
                        records = zip_records(stand_in)
                        parts = Skeleton(read(stand_in))
            else:  # opened once: its records, torch's read and this rank's own reads are of one file
                location = stack.enter_context(pinned(location))
                records = zip_records(location)
                if records is not None:
                    parts = Skeleton(read(location))
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = err
        return _read_once(location, device, parts, records, remote, error, verify=verify)


def _read_once(
    location: Location,
    device: torch.device,
    parts: Skeleton | None,
    records: dict[int, tuple[str, int, int]] | None,
    remote: RemoteZip | None,
    error: BaseException | None,
    *,
    verify: bool,
) -> Any:
    """`read_once` from the exchange of what each rank found on: every rank's shape, then the reads."""
    rank, world = get_rank(), get_world_size()
    agreement = Agreement(f"loading checkpoint {location.url}", own="as_is")
    # The same local zip on every rank (a filesystem they share: the same records, sizes and CRC-32s
    # in its directory); else every rank reads another way (a rank that failed: each rank reads as
    # before, and the error comes with what to do about it).
    shape = None if parts is None else (sorted((records or {}).items()), parts.sizes())
    shapes = all_gather_object("failed" if error else shape)
    if "failed" in shapes:
        raise ReadAnotherWay("each")
    if any(shape is None for shape in shapes):
        raise ReadAnotherWay("rank0")  # remote or legacy: rank 0 reads it once and sends it
    if any(shape != shapes[0] for shape in shapes):
        if rank == 0:
            log.warn(f"{location.url} differs between ranks (node-local copies?): each rank reads its own file")
        raise ReadAnotherWay("each")
    assert parts is not None
    pieces = pieces_of(parts.sizes(), world)
    error = None
    storages: list[Any] = []
    split: list[tuple[int, str, int]] = []
    try:
        storages, split = _read_owned(location, parts, pieces, records or {}, verify=verify, device=device,
                                      remote=remote)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = err
    agreement.on_every_rank(error)
    nccl = torch.distributed.get_backend() == "nccl"
    comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    share_pieces(storages, pieces, comm_device=comm)  # on the GPU with nccl: straight into each rank's own
    if verify and len({p[0] for p in pieces}) < len(pieces):  # a storage in several pieces (the same on every rank)
        # A storage read by several ranks is whole only now: its first reader checks its CRC-32.
        damaged = next((name for index, name, crc in split if crc >= 0 and crc != _crc(storages[index])), None)
        agreement.on_every_rank(None if damaged is None else damaged_record(location.url, damaged))
    for index, _, _ in split:
        storages[index] = storages[index].to(device=device)
    return parts.rebuilt(storages, device)


def _read_owned(
    location: Location,
    parts: Skeleton,
    pieces: list[tuple[int, int, int, int]],
    records: dict[int, tuple[str, int, int]],
    *,
    verify: bool,
    device: torch.device,
    remote: RemoteZip | None = None,
) -> tuple[list[Any], list[tuple[int, str, int]]]:
    """Every storage of the tree: this rank's pieces (`pieces_of`) read from the file (``pread``, no
    readahead into the others' bytes; from an object store, ranged GETs: ``remote``), the rest
    allocated to receive. A storage read whole by this rank is on ``device``, its CRC-32 checked with
    ``verify``; one read in pieces by several ranks stays on the CPU until the exchange made it whole
    (`_read_once` moves it). Returns the storages and, for each split storage this rank read a piece of,
    ``(index, record, CRC-32)``, the CRC-32 to check where this rank read its first piece (else -1).

    A storage torch mapped lies at its record's offset in the file; where that cannot be told (not
    mapped as torch maps a file), the pieces are copied from the mapping instead (never from an
    object store: its stand-in holds no storage's bytes)."""
    rank = get_rank()
    pointers = [int(s.data_ptr()) for s in parts.storages]
    low = min(pointers, default=0)
    base = next((low - start for start in sorted(records) if all(p - (low - start) in records for p in pointers)), None)
    if base is None and remote is not None:
        raise CheckpointFormatError(f"{location.url}: its storages are not where its records are; load it with "
                                    "read='rank0'")  # fmt: skip
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for index, start, length, owner in pieces:
        by_storage.setdefault(index, []).append((start, length, owner))
    out: list[Any] = []
    split: list[tuple[int, str, int]] = []
    reads: list[tuple[str, int, int, memoryview]] = []  # (record, its data's start, offset in it, where it goes)
    whole: list[tuple[int, str, int, memoryview]] = []  # storages read whole here: (index, record, CRC-32, bytes)
    for index, (storage, pointer) in enumerate(zip(parts.storages, pointers)):
        size = int(storage.nbytes())
        cut = by_storage.get(index, [(0, size, 0)])
        own = [(start, length) for start, length, owner in cut if owner == rank]
        if not own:
            out.append(torch.UntypedStorage(size, device=device))  # type: ignore[no-untyped-call]
            continue
        fresh = torch.UntypedStorage(size)  # type: ignore[no-untyped-call]
        view = memoryview(_bytes(fresh).numpy())  # type: ignore[arg-type]
        name, crc = ("", 0) if base is None else (records[pointer - base][0], records[pointer - base][2])
        if base is None:
            source = _bytes(storage)
            for start, length in own:
                _bytes(fresh)[start : start + length].copy_(source[start : start + length])
        else:
            reads += [(name, pointer - base, start, view[start : start + length]) for start, length in own]
        if len(cut) > 1:
            split.append((index, name, crc if base is not None and own[0][0] == cut[0][0] else -1))
        else:
            whole.append((index, name, crc, view))
        out.append(fresh)
    if remote is not None:
        remote.read_into([(name, view, offset) for name, _, offset, view in reads])
    else:
        with _Reader(location.path) as reader:
            for name, start, offset, view in reads:
                if not reader.read_into(view, start + offset):
                    raise damaged_record(location.url, name)
    for index, name, crc, view in whole:
        if verify and base is not None and crc32(view) != crc:
            raise damaged_record(location.url, name)
        out[index] = out[index].to(device=device)
    if verify and base is None:
        check_records(location, [s for i, s in enumerate(sorted(records)) if i % get_world_size() == rank])
    elif verify and rank == 0 and remote is None:  # the records no tensor holds (data.pkl was checked as it was read)
        held = {pointer - base for pointer in pointers}  # type: ignore[operator]
        check_records(location, [start for start in sorted(records) if start not in held])
    return out, split


class _Reader:
    """Reads byte ranges of a file, each from the disk and nothing around it: with ``O_DIRECT`` (the
    range widened to whole 4 KiB blocks, bypassing the page cache and its readahead) where the
    filesystem allows it, else plain reads with readahead off (a mark another reader left in the page
    cache can still pull in ``read_ahead_kb`` more)."""

    BLOCK = 4096
    CHUNK = 64 << 20

    def __init__(self, path: str) -> None:
        self.path = path
        self.block: mmap.mmap | None = None
        self.direct = -1
        with contextlib.suppress(OSError, AttributeError):  # tmpfs and some FUSE mounts refuse O_DIRECT
            self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.plain = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.plain, 0, 0, os.POSIX_FADV_RANDOM)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in (self.direct, self.plain):
            if fd >= 0:
                os.close(fd)
        if self.block is not None:
            self.block.close()

    def _direct(self, view: memoryview, offset: int) -> bool:
        """`read_into` through ``O_DIRECT``: whole blocks, 64 MiB at a time, into one page-aligned buffer."""
        if self.block is None:
            self.block = mmap.mmap(-1, self.CHUNK + 2 * self.BLOCK)  # its pages are touched only as used
        buffer = memoryview(self.block)
        try:
            done = 0
            while done < len(view):
                at = offset + done
                start = at - at % self.BLOCK
                take = min(self.CHUNK, len(view) - done)
                end = -(-(at + take) // self.BLOCK) * self.BLOCK
                if os.preadv(self.direct, [buffer[: end - start]], start) < at - start + take:
                    return False
                view[done : done + take] = buffer[at - start : at - start + take]
                done += take
        finally:
            buffer.release()
        return True

    def read_into(self, view: memoryview, offset: int) -> bool:
        """``len(view)`` bytes from ``offset`` into ``view``; False if the file ends first."""
        if self.direct >= 0:
            try:
                return self._direct(view, offset)
            except OSError:  # an alignment this filesystem refuses: plain reads from now on
                os.close(self.direct)
                self.direct = -1
        done = 0
        while done < len(view):
            got = os.preadv(self.plain, [view[done:]], offset + done)
            if not got:
                return False
            done += got
        return True


def _crc(storage: Any) -> int:
    return crc32(memoryview(_bytes(storage).numpy()))  # type: ignore[arg-type]


def _bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
