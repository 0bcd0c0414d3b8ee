"""A torch zip in an object store, read in ranges, for a restore that reads each byte once
(`ckptools.read.once`): its directory, a local stand-in that torch maps as it maps the object, and
the bytes of the records a rank reads.

An object store has no ``pread`` and no mapping. So each rank reads the object's end (the central
directory: names, sizes, CRC-32s, where each local header starts) and the small records
(``data.pkl``, ``version``, ...), and writes a *stand-in*: a local sparse file with the same records,
the small ones filled, every storage's bytes a hole (nothing written, nothing read). ``torch.load``
maps the stand-in as it would map the object, which gives the tree and its storages in order; each
rank then fetches the storages it owns from the object with ranged GETs, `RANGES_AT_ONCE` at a time.

Where each record's data starts is the one thing the directory does not say (a local header's extra
field pads the data to its alignment): every writer torch's reader accepts without complaint (torch,
ckptools, zipfile) puts each record's data right before the next local header, so a record's data
ends where the next header (or the directory) begins. That is checked on every header read: the
small records' by every rank, each storage's by the rank that fetches it (its header comes in the same
GET). A file laid out otherwise is read by rank 0 alone and sent (``read="rank0"``).
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..codecs.torchzip import ZipPlan, storage_key
from ..errors import CheckpointFormatError
from ..layouts import damaged_record
from ..storage import RANGE_BYTES, RANGES_AT_ONCE, Location, crc32, ranged_reads, report_progress, resolve

__all__ = ["RemoteZip", "Unranged", "check_in_ranges", "reads_in_ranges"]

# Ranged GETs of at most RANGE_BYTES, RANGES_AT_ONCE in flight per rank: storage's, as for every remote read.
_TAIL = 1 << 16  # the end of the object read first: the end record and, mostly, the directory


def reads_in_ranges(location: Location) -> bool:
    """Whether ``location`` is a remote file on a filesystem that makes ranged reads concurrently
    (fsspec's async ones: s3fs, gcsfs, adlfs, HTTP)."""
    return not location.local and ranged_reads(location.fs)


def check_in_ranges(location: Location) -> bool:
    """Check an object's container in a few ranged GETs (its directory, every record inside the object, the
    small records with their CRC-32s) and not its storages, which a verified load checks as each rank reads
    them: True. False where it cannot be read so (no ranged reads, not laid out as torch lays out a zip):
    the caller checks it whole.

    Raises:
        CheckpointFormatError: a small record is damaged.
    """
    if not reads_in_ranges(location):
        return False
    try:
        RemoteZip(location, verify=True)
    except Unranged:
        return False
    return True


class _Ranges(io.RawIOBase):
    """The object as a seekable file for ``zipfile`` (its directory only): the tail fetched once,
    any other range on demand."""

    def __init__(self, fs: Any, path: str, size: int) -> None:
        self.fs, self.path, self.size, self.at = fs, path, size, 0
        self.tail_at = max(0, size - _TAIL)
        self.tail = bytes(fs.cat_file(path, start=self.tail_at, end=size))

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = {0: offset, 1: self.at + offset, 2: self.size + offset}[whence]
        return self.at

    def tell(self) -> int:
        return self.at

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.at + n)
        if self.at >= self.tail_at:
            data = self.tail[self.at - self.tail_at : end - self.tail_at]
        else:
            data = bytes(self.fs.cat_file(self.path, start=self.at, end=end)) if end > self.at else b""
        self.at += len(data)
        return data


# The bytes a zip writer may put after a record's data: none, or a data descriptor (with or without
# its signature; zip64: 8-byte sizes).
_DESCRIPTORS = frozenset({0, 12, 16, 20, 24})


class Unranged(Exception):
    """The object is not a zip, or its records do not lie one after another: it is not read in ranges
    (`ckptools.read.once` has rank 0 read it, whose reader says what it is)."""


class RemoteZip:
    """A remote torch zip's directory: each record's ``(header offset, data start, size, CRC-32)`` by
    name, in file order; `small` the records that are not storages, fetched, their headers checked
    (with ``verify`` their CRC-32s too).

    Raises:
        Unranged: see there.
        CheckpointFormatError: with ``verify``, a small record's CRC-32 does not match.
    """

    def __init__(self, location: Location, *, verify: bool = False) -> None:
        self.location = location
        fs, path = location.fs, location.path
        self.size = int(fs.size(path))
        try:
            with zipfile.ZipFile(_Ranges(fs, path, self.size)) as archive:
                infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
                directory = archive.start_dir
        except (zipfile.BadZipFile, ValueError, EOFError, struct.error) as err:
            raise Unranged(f"{location.url} is not a zip ({type(err).__name__}: {err})") from err
        ends = [info.header_offset for info in infos[1:]] + [directory]
        self.records: dict[str, tuple[int, int, int, int]] = {}
        for info, end in zip(infos, ends):
            self.records[info.filename] = (info.header_offset, end - info.file_size, info.file_size, info.CRC)
        names = [name for name in self.records if storage_key(name) is None]
        try:
            blobs = self._fetch_raw(names)
            self._after_descriptors(names, blobs)
            self.small = {name: bytes(self.data_of(name, blob)) for name, blob in zip(names, blobs)}
        except CheckpointFormatError as err:  # a header elsewhere than where the layout puts it
            raise Unranged(str(err)) from err
        for name, data in self.small.items():
            if verify and crc32(data) != self.records[name][3]:
                raise damaged_record(location.url, name)

    def _fetch_raw(self, names: list[str]) -> list[bytes]:
        """Each named record's bytes from its local header to the next record's header (its data, and
        the data descriptor a streaming writer puts after it)."""
        starts = [self.records[name][0] for name in names]
        ends = [self.records[name][1] + self.records[name][2] for name in names]
        fs = self.location.fs
        got = fs.cat_ranges([self.location.path] * len(names), starts, ends, batch_size=RANGES_AT_ONCE,
                            on_error="raise")  # fmt: skip
        return [bytes(blob) for blob in got]

    def _after_descriptors(self, names: list[str], blobs: list[bytes]) -> None:
        """Where each record's data starts, when a data descriptor follows each record's data.

        ckptools' writer puts each record's data right before the next header; torch's own writer
        (``torch.save``, ``writers="rank0"``) puts a 16-byte data descriptor there (its local headers
        flag it). The small records, fetched header to next header, say how long the descriptor is;
        one writer writes every record alike, and each storage's own header is checked again as its
        first range is read (`_after_header`)."""
        found = {
            len(blob) - self._header_length(name, blob) - self.records[name][2] for name, blob in zip(names, blobs)
        }
        if len(found) != 1 or next(iter(found)) not in _DESCRIPTORS:
            return  # no small record, or a layout this reader does not know: `data_of` says which record
        trailing = found.pop()
        if trailing:
            for name, (header, start, size, crc) in self.records.items():
                self.records[name] = (header, start - trailing, size, crc)

    def data_of(self, name: str, blob: bytes | memoryview) -> bytes | memoryview:
        """A record's data from ``blob`` (its bytes from its local header on), the header checked."""
        size = self.records[name][2]
        data = self._after_header(name, blob)[:size]  # a data descriptor may follow
        if len(data) != size:
            raise CheckpointFormatError(f"{self.location.url} ended early while {name} was read")
        return data

    def _after_header(self, name: str, blob: bytes | memoryview) -> bytes | memoryview:
        """``blob`` (bytes from record ``name``'s local header on) past its header, which must say
        that the data starts where this reader took it to start."""
        header, start, _, _ = self.records[name]
        skip = start - header
        if self._header_length(name, blob) != skip:
            raise CheckpointFormatError(f"{self.location.url}: record {name} is not where its header says")
        return blob[skip:]

    def _header_length(self, name: str, blob: bytes | memoryview) -> int:
        """The length of record ``name``'s local header, the first bytes of ``blob``, which must be its
        header (its signature, and ``name``)."""
        if len(blob) < 30 or bytes(blob[:4]) != b"PK\x03\x04":
            raise CheckpointFormatError(f"{self.location.url}: record {name} is not where its header says")
        n, m = (int(x) for x in struct.unpack("<HH", bytes(blob[26:30])))
        if bytes(blob[30 : 30 + n]) != name.encode():
            raise CheckpointFormatError(f"{self.location.url}: record {name} is not where its header says")
        return 30 + n + m

    @contextmanager
    def stand_in(self) -> Iterator[Location]:
        """A local sparse file with this object's records (the small ones filled, the storages
        holes: none of their bytes is written or read), removed on leaving (a mapping of it stays)."""
        records = [(name, rec[2]) for name, rec in self.records.items()]
        plan = ZipPlan(records)
        handle, path = tempfile.mkstemp(prefix="ckptools-stand-in-", suffix=f"-{self.location.name}")
        try:
            with os.fdopen(handle, "wb") as f:
                f.truncate(plan.size)
                crcs = [rec[3] for rec in self.records.values()]
                for index, (name, _) in enumerate(records):
                    f.seek(plan.header_offsets[index])
                    f.write(plan.header(index, crcs[index]))
                    if name in self.small:
                        f.write(self.small[name])
                f.seek(plan.directory_offset)
                f.write(plan.directory(crcs))
            yield resolve(path)
        finally:
            os.unlink(path)

    def read_into(self, wanted: list[tuple[str, memoryview, int]]) -> None:
        """Each named record's data from ``offset`` on into its view (``len(view)`` bytes: the whole
        record, or a piece of it another rank's pieces complete), in ranged GETs of at most
        `RANGE_BYTES`, `RANGES_AT_ONCE` in flight (a record's first range from its header on, the
        header checked)."""
        ranges = []  # (name, first byte, end, view, the view's first byte in the object)
        for name, view, offset in wanted:
            header, start, _, _ = self.records[name]
            first, end = start + offset, start + offset + len(view)
            cuts = [header if offset == 0 else first, *range(first + RANGE_BYTES, end, RANGE_BYTES), end]
            ranges += [(name, a, b, view, first) for a, b in zip(cuts, cuts[1:])]
        fs, path = self.location.fs, self.location.path
        for batch in _batches(ranges):
            got = fs.cat_ranges([path] * len(batch), [r[1] for r in batch], [r[2] for r in batch],
                                batch_size=RANGES_AT_ONCE, on_error="raise")  # fmt: skip
            for (name, a, b, view, first), blob in zip(batch, got):
                header, start, _, _ = self.records[name]
                if a == header and first == start:
                    blob, a = self._after_header(name, blob), start
                if len(blob) != b - a:
                    raise CheckpointFormatError(f"{self.location.url} ended early while {name} was read")
                view[a - first : b - first] = blob
                report_progress(len(blob))


def _batches(ranges: list[Any]) -> Iterator[list[Any]]:
    """``ranges`` (name, start, end, view) in batches asked for at once: at most 128 MiB (what memory
    holds of them at a time) and 64 ranges (many small records go out together, not 8 at a time)."""
    batch: list[Any] = []
    held = 0
    for item in ranges:
        if batch and (held + item[2] - item[1] > 8 * RANGE_BYTES or len(batch) == 64):
            yield batch
            batch, held = [], 0
        batch.append(item)
        held += item[2] - item[1]
    if batch:
        yield batch
