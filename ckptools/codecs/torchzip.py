"""The torch zip container without torch: a reader that checks every record, and a writer.

A torch checkpoint (``torch.save`` since 1.6) is an uncompressed zip archive: ``data.pkl`` holds
the object structure, each storage sits raw in its own ``data/N`` record (64-byte aligned, so
``torch.load(mmap=True)`` can map it). Renaming keys only changes ``data.pkl``, so ckptools
rewrites that record and copies every other record byte for byte (``copy_file_range``) — no
tensor is decoded, memory stays flat, and ``import torch`` (over a second) is not needed.
"""

from __future__ import annotations

import re
import struct
import zipfile
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

from ..errors import CheckpointError, CheckpointFormatError, CheckpointLayoutError
from ..storage import PathLike, copy_range, crc32, open_for_read, open_local, resolve
from .dtypes import STORAGE_ITEMSIZE

if TYPE_CHECKING:
    from .parsed import StorageRef

# The first bytes of every zip archive (a local file header).
ZIP_MAGIC = b"PK\x03\x04"


class TorchZip:
    """The records of a torch zip checkpoint: names, sizes, CRC-32s and where their data starts.

    Opening one checks the container as torch's reader (miniz and ``PyTorchStreamReader``) and
    ``torch.load`` check it, so that nothing ckptools reads without torch is a file torch refuses:
    one archive on one disk, no encryption, record names in UTF-8 and all in the folder of the
    first record, every record stored (uncompressed) and inside the file, a ``version`` record that
    torch supports, a ``byteorder`` of ``little`` or ``big``, an integer ``.storage_alignment``.
    ``handle`` (an open binary file) is read instead of opening ``path``.
    """

    # caffe2/serialize/versions.h: kMinSupportedFileFormatVersion, kMaxSupportedFileFormatVersion.
    VERSIONS = range(1, 11)

    def __init__(self, path: str, handle: IO[bytes] | None = None) -> None:
        self.path = path
        try:
            if handle is not None:
                self._scan(handle)
            else:
                with open_local(path) as f:
                    self._scan(f)
        except CheckpointError:  # not found, or no regular file (open_local)
            raise
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, struct.error) as err:
            # zipfile raises more than BadZipFile on damaged directories (UnicodeDecodeError for
            # a mangled name, ValueError for negative seeks, EOFError for short reads).
            raise CheckpointFormatError(
                f"{path} is truncated or not a torch zip checkpoint ({type(err).__name__}: {err})"
            ) from err

    def _scan(self, f: IO[bytes]) -> None:
        path = self.path
        self.size = size = f.seek(0, 2)
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            self.infos = archive.infolist()
            directory_at = self.directory_at = archive.start_dir
        self._check_kind([info.filename for info in self.infos])
        self._check_directory(f, directory_at)
        if not self.infos or "/" not in self.infos[0].filename:
            raise CheckpointFormatError(
                f"{path} is a zip file but not a torch checkpoint (no data.pkl in an archive folder)"
            )
        self.prefix = self.infos[0].filename.split("/", 1)[0] + "/"
        self.starts: list[int] = []
        self.records: dict[str, tuple[int, int]] = {}
        for info in self.infos:
            self._check_record(f, info, size)
        if "data.pkl" not in self.records:
            raise CheckpointFormatError(f"{path} is a zip file but not a torch checkpoint (no data.pkl)")
        self.pkl_index = [i.filename for i in self.infos].index(self.prefix + "data.pkl")
        self._check_small_records(f)

    def _check_kind(self, names: list[str]) -> None:
        """A zip of another kind (TorchScript, torch.export, a zip without torch's records) named as
        what it is: a valid file of another kind is never called corrupt."""
        path = self.path
        if any(name.endswith("/constants.pkl") for name in names):  # torch's own test for TorchScript
            raise CheckpointLayoutError(
                f"{path} is a TorchScript archive (torch.jit.save), not a checkpoint: load it with "
                "torch.jit.load(path); its weights are torch.jit.load(path).state_dict()"
            )
        # The .pt2 layout of torch 2.7 on (an archive_format record), and of 2.6 and before (the program as JSON).
        if any(name.endswith("/archive_format") or name == "serialized_exported_program.json" for name in names):
            raise CheckpointLayoutError(
                f"{path} is a torch.export archive (.pt2), not a checkpoint: load it with torch.export.load(path)"
            )
        if not any(re.search(r"/(data\.pkl|data/\d+|version|byteorder)$", name) for name in names):
            # Nothing of torch's: another kind of zip file, not a damaged checkpoint.
            raise CheckpointLayoutError(f"{path} is a zip file but not a torch checkpoint (no data.pkl)")

    def _check_record(self, f: IO[bytes], info: zipfile.ZipInfo, size: int) -> None:
        """One record of the directory against its local header, as torch reads it; its data's
        start and length recorded."""
        path = self.path
        name = info.filename
        # The name's bytes, as stored: zipfile decoded them as cp437 unless flagged UTF-8.
        raw = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        raw.decode("utf-8")  # torch reads names as UTF-8: UnicodeDecodeError, refused by __init__
        if name.endswith("/"):
            raise CheckpointFormatError(f"{path}: record {name} is a folder; torch never writes one")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFormatError(f"{path}: record {name} is compressed; torch never does that")
        if not name.startswith(self.prefix):
            raise CheckpointFormatError(f"{path}: record {name} lies outside the archive folder {self.prefix}")
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointFormatError(f"{path}: record {name} has a damaged header")
        flags, method = struct.unpack("<HH", header[6:10])
        n, m = struct.unpack("<HH", header[26:30])
        local = f.read(n + m)
        # The local header must describe the record the directory describes: torch takes the
        # data's start from it, so a damaged one shifts every byte read (found by fuzzing).
        if local[:n] != raw or (flags & ~_FLAGS or method != zipfile.ZIP_STORED or not _whole_blocks(local[n:])):
            raise CheckpointFormatError(f"{path}: record {name} has a damaged header")
        start = info.header_offset + 30 + n + m
        if start + info.file_size > size:
            raise CheckpointFormatError(f"{path}: record {name} runs past the end (truncated file)")
        self.starts.append(start)
        key = name[len(self.prefix) :]
        if key in self.records:
            raise CheckpointFormatError(f"{path}: the archive holds two records named {name}")
        self.records[key] = (start, info.file_size)

    def _check_small_records(self, f: IO[bytes]) -> None:
        """The small records torch.load reads before any tensor, judged as torch judges them."""
        path = self.path
        version = self._small(f, "version")
        digits = re.match(rb"[ \t\n\v\f\r]*\+?([0-9]+)", version or b"")
        if version is None or digits is None or int(digits.group(1)) not in self.VERSIONS:
            raise CheckpointFormatError(
                f"{path}: the archive's version record is {'missing' if version is None else repr(version[:20])}; "
                f"torch reads versions {self.VERSIONS.start} to {self.VERSIONS.stop - 1}"
            )
        self.byteorder = self._small(f, "byteorder") or b"little"
        if self.byteorder not in (b"little", b"big"):
            raise CheckpointFormatError(f"{path}: unknown byte order {self.byteorder[:20]!r}")
        alignment = self._small(f, ".storage_alignment")
        if alignment is not None:
            try:
                int(alignment)  # as torch.load reads it
            except ValueError:
                raise CheckpointFormatError(f"{path}: .storage_alignment {alignment[:20]!r} is not a number") from None

        serialization_id = self._small(f, ".data/serialization_id")
        if serialization_id is not None:
            serialization_id.decode("utf-8")  # torch.load decodes it: UnicodeDecodeError, refused by __init__

    def _check_directory(self, f: IO[bytes], directory_at: int) -> None:
        """The end records and the central directory as miniz reads them. Python's zipfile is
        more forgiving (it guesses where the zip64 end record is, ignores the disk fields, cuts
        comments short), so where the two could read a damaged file differently it is refused."""
        # What ZipFile itself parsed: [sig, disk, directory disk, entries here, entries, directory
        # size, directory offset, comment length, comment, end record location].
        end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        damaged = CheckpointFormatError(f"{self.path}: the zip directory is damaged (truncated or corrupt file)")
        if end is None or end[1] or end[2] or end[3] != end[4] or end[4] != len(self.infos) or end[6] != directory_at:
            raise damaged
        if end[0] == b"PK\x06\x06":  # zip64: the locator must point at the zip64 end record
            f.seek(end[9] - 20)
            signature, disk, where, disks = struct.unpack("<4sLQL", f.read(20))
            f.seek(where)
            head = f.read(12)
            if (
                signature != b"PK\x06\x07"
                or disk
                or disks != 1
                or where != end[9] - 20 - 56
                or head != (b"PK\x06\x06" + struct.pack("<Q", 44))
            ):
                raise damaged
        # Each entry as miniz reads it, from the raw bytes (zipfile's ZipInfo cuts short what runs past).
        f.seek(directory_at)
        directory = f.read(end[5])
        at = 0
        for info in self.infos:
            if directory[at : at + 4] != b"PK\x01\x02" or len(directory) < at + 46:
                raise damaged
            flags = struct.unpack_from("<H", directory, at + 8)[0]
            n, m, k, disk = struct.unpack_from("<4H", directory, at + 28)
            external = struct.unpack_from("<L", directory, at + 38)[0]
            # Flags other than "sizes follow the data" and "UTF-8 name" (encryption, patches), an
            # entry on another disk, the DOS directory attribute (miniz then reads nothing), a
            # stored size given twice differently: torch refuses or misreads each of them.
            if (
                flags & ~_FLAGS or disk or external & 0x10
                or (info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size)
                or at + 46 + n + m + k > len(directory) or not _whole_blocks(directory[at + 46 + n : at + 46 + n + m])
            ):  # fmt: skip
                raise damaged
            at += 46 + n + m + k
        if at != end[5]:
            raise damaged

    def _small(self, f: IO[bytes], name: str) -> bytes | None:
        if name not in self.records:
            return None
        start, length = self.records[name]
        if length > 4096:
            raise CheckpointFormatError(f"{self.path}: record {name} is {length} bytes; torch writes a few")
        f.seek(start)
        return f.read(length)

    def check_storages(self, storages: Iterable[StorageRef]) -> None:
        """Every storage the pickle names has a record holding all its bytes (torch reads past
        the end of a short record without noticing: uninitialised memory or the next record)."""
        for ref in storages:
            record = self.records.get("data/" + ref.key)
            if record is None:
                raise CheckpointFormatError(f"{self.path}: data.pkl names storage {ref.key!r}, which has no record")
            itemsize = STORAGE_ITEMSIZE.get(ref.storage_type.name, ("", 1))[1]
            if record[1] < ref.numel * itemsize:
                raise CheckpointFormatError(
                    f"{self.path}: record data/{ref.key} holds {record[1]} bytes, but its storage has "
                    f"{ref.numel * itemsize} (truncated or corrupt file)"
                )

    def read_pickle(self, handle: IO[bytes]) -> bytes:
        """``data.pkl``, its CRC-32 checked, read from ``handle``: the file this archive was read from."""
        info, start = self.infos[self.pkl_index], self.starts[self.pkl_index]
        handle.seek(start)
        data = handle.read(info.file_size)
        if crc32(data) != info.CRC:
            raise CheckpointFormatError(f"{self.path}: record {info.filename} is damaged (CRC-32 mismatch)")
        return data

    def write_with_pickle(
        self, src: IO[bytes], out: IO[bytes], pickle_bytes: bytes, *, force_zip64: bool = False
    ) -> None:
        """Write this archive to ``out`` with ``data.pkl`` replaced; other records copied raw from
        ``src``, the file this archive was read from."""
        writer = _ZipWriter(out, force_zip64=force_zip64)
        for index, (info, start) in enumerate(zip(self.infos, self.starts)):
            if index == self.pkl_index:
                writer.add(info.filename, len(pickle_bytes), crc32(pickle_bytes), lambda: out.write(pickle_bytes))
            else:
                writer.add(info.filename, info.file_size, info.CRC, _copier(src, out, start, info.file_size))
        writer.finish()


# The general-purpose flags torch's writer sets: sizes in a descriptor after the data, UTF-8 names.
_FLAGS = 0x0008 | 0x0800


def _whole_blocks(extra: bytes) -> bool:
    """Whether a zip extra field is a sequence of complete (id, length, data) blocks."""
    at = 0
    while at + 4 <= len(extra):
        at += 4 + int.from_bytes(extra[at + 2 : at + 4], "little")
    return at == len(extra)


def _copier(src: IO[bytes], out: IO[bytes], start: int, length: int) -> Any:
    def copy() -> None:
        copy_range(src, out, start, length)

    return copy


ALIGN = 64  # torch aligns every record's data on 64 bytes (mmap needs it)
_LIMIT = 0xFFFFFFFF


def storage_key(name: str) -> str | None:
    """The key of a storage's record (``archive/data/3``: ``"3"``), or None for any other record.

    Examples:
        >>> [storage_key(n) for n in ("archive/data/3", "archive/.data/serialization_id", "archive/data.pkl")]
        ['3', None, None]
    """
    folder, _, key = name.rpartition("/")
    return key if folder.endswith("/data") and folder.count("/") == 1 and key.isdigit() else None


def local_header(name: str, size: int, crc: int, offset: int, *, force_zip64: bool = False) -> bytes:
    """The local header of a stored record that starts at ``offset``, padded so that its data
    starts on a 64-byte boundary; its length does not depend on ``crc`` (planned layouts)."""
    raw = name.encode("utf-8")
    zip64 = force_zip64 or size >= _LIMIT
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    # A padding extra field (id 'FB', as torch's writer uses) puts the data on a 64-byte boundary.
    pad = -(offset + 30 + len(raw) + len(extra) + 4) % ALIGN
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    sizes = _LIMIT if zip64 else size
    version = 45 if zip64 else 20
    fields = (0x04034B50, version, 0, 0, 0, 0x21, crc, sizes, sizes, len(raw), len(extra))
    return struct.pack("<IHHHHHIIIHH", *fields) + raw + extra


def central_directory(entries: list[tuple[str, int, int, int]], start: int, *, force_zip64: bool = False) -> bytes:
    """The central directory and end records of stored records ``(name, size, crc, header
    offset)``, the directory starting at ``start``."""
    force = force_zip64
    central = bytearray()
    for name, size, crc, offset in entries:
        raw = name.encode("utf-8")
        fields = []
        if force or size >= _LIMIT:
            fields += [size, size]
        if force or offset >= _LIMIT:
            fields.append(offset)
        extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
        sizes = _LIMIT if (force or size >= _LIMIT) else size
        local = _LIMIT if (force or offset >= _LIMIT) else offset
        version = 45 if fields else 20
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, version, 0, 0, 0, 0x21, crc, sizes, sizes, len(raw), len(extra),
            0, 0, 0, 0, local,
        )  # fmt: skip
        central += raw + extra
    cd_size, count = len(central), len(entries)
    end = start + cd_size
    if force or count >= 0xFFFF or start >= _LIMIT or cd_size >= _LIMIT:
        central += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, start)
        central += struct.pack("<IIQI", 0x07064B50, 0, end, 1)
        central += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _LIMIT, _LIMIT, 0)
    else:
        central += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, start, 0)
    return bytes(central)


class ZipPlan:
    """Where every record of a stored zip goes, decided before any byte is written, so that
    several writers can fill their records at once (`ckptools.write.plan`).

    ``records`` are ``(name, size)`` in file order; ``data_offsets[i]`` is where record ``i``'s
    data starts, ``header_offsets[i]`` its local header, ``size`` the whole file's length.

    Examples:
        >>> plan = ZipPlan([("archive/data/0", 12)])
        >>> plan.data_offsets[0] % 64, plan.size > 12
        (0, True)
    """

    def __init__(self, records: list[tuple[str, int]], *, force_zip64: bool = False) -> None:
        self.records, self.force = list(records), force_zip64
        self.header_offsets: list[int] = []
        self.data_offsets: list[int] = []
        offset = 0
        for name, size in self.records:
            self.header_offsets.append(offset)
            offset += len(local_header(name, size, 0, offset, force_zip64=force_zip64))
            self.data_offsets.append(offset)
            offset += size
        self.directory_offset = offset
        entries = [(name, size, 0, at) for (name, size), at in zip(self.records, self.header_offsets)]
        self.size = offset + len(central_directory(entries, offset, force_zip64=force_zip64))

    def header(self, index: int, crc: int) -> bytes:
        """Record ``index``'s local header, with its data's CRC-32."""
        name, size = self.records[index]
        return local_header(name, size, crc, self.header_offsets[index], force_zip64=self.force)

    def directory(self, crcs: list[int]) -> bytes:
        """The central directory and end records, given every record's CRC-32."""
        entries = [(n, s, c, at) for (n, s), c, at in zip(self.records, crcs, self.header_offsets)]
        return central_directory(entries, self.directory_offset, force_zip64=self.force)


class _ZipWriter:
    """A minimal writer of stored (uncompressed) zip records, data 64-byte aligned, zip64 as needed."""

    def __init__(self, out: IO[bytes], *, force_zip64: bool = False) -> None:
        self.out, self.force = out, force_zip64
        self.offset = 0
        self.entries: list[tuple[str, int, int, int]] = []

    def add(self, name: str, size: int, crc: int, write_data: Any) -> None:
        header = local_header(name, size, crc, self.offset, force_zip64=self.force)
        self.out.write(header)
        write_data()
        self.entries.append((name, size, crc, self.offset))
        self.offset += len(header) + size

    def finish(self) -> None:
        self.out.write(central_directory(self.entries, self.offset, force_zip64=self.force))


def read_local_zip(path: PathLike) -> tuple[TorchZip, bytes] | None:
    """A local file read with one open: its parsed directory and ``data.pkl`` (CRC-32 checked), or
    None when it does not start as a zip. Raises as `is_local_zip` and `TorchZip` do.

    Examples:
        >>> read_local_zip(__file__) is None  # a Python file: no zip
        True
    """
    opened = open_local_zip(path)
    if opened is None:
        return None
    archive, f = opened
    with f:
        return archive, archive.read_pickle(f)


def open_local_zip(path: PathLike) -> tuple[TorchZip, IO[bytes]] | None:
    """A local file opened once and its directory parsed: the archive and the open file every later
    read of it goes through (the caller closes it); None for a remote file or one that does not start
    as a zip. Raises as `is_local_zip` and `TorchZip` do.

    Examples:
        >>> open_local_zip(__file__) is None  # a Python file: no zip
        True
    """
    location = resolve(path)
    if not location.local:
        return None
    f, _ = open_for_read(location)
    try:
        if f.read(4) != ZIP_MAGIC:
            f.close()
            return None
        return TorchZip(location.url, f), f  # named as given (a `pinned` file's path names the descriptor)
    except BaseException:
        f.close()
        raise


def is_local_zip(path: PathLike) -> bool:
    """Whether ``path`` is a local file that starts as a zip does (a remote one is not fetched to say).

    Raises the clear not-found and is-a-directory errors of `ckptools.storage.open_for_read`.
    """
    location = resolve(path)
    if not location.local:
        return False
    f, _ = open_for_read(location)
    with f:
        return f.read(4) == ZIP_MAGIC
