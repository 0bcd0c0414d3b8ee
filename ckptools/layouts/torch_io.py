"""The torch adapter: the one place a torch checkpoint file becomes objects, and objects one.

``torch.load`` runs with ``weights_only=True`` unless the caller opts out, and torch's assorted
errors (RuntimeError from miniz, UnpicklingError, EOFError, ...) are turned into
`CheckpointFormatError` or `UnsafeCheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import os
import pickle
import re
import struct
import zlib
from typing import IO, Any

from ..codecs.legacy import check_non_zip
from ..codecs.pickles import build_refusal, loads
from ..codecs.sniff import other_kind
from ..codecs.torchzip import ZIP_MAGIC, TorchZip
from ..errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointLayoutError,
    MissingClassError,
    UnsafeCheckpointError,
)
from ..storage import (
    Location,
    PathLike,
    atomic_write,
    crc32_mapped,
    crc32_range,
    fspath,
    mapped_path,
    open_for_read,
)

GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def save_file(path: PathLike, obj: Any) -> int:
    """``torch.save`` ``obj`` to ``path`` atomically (see `ckptools.storage.atomic_write`).

    Returns:
        The number of bytes written.
    """
    import torch  # here: reading and checking files needs no torch

    written = 0

    def write(f: IO[bytes]) -> None:
        nonlocal written
        torch.save(obj, f)
        written = f.tell()  # torch writes front to back: where it stopped is the size

    atomic_write(path, write, streamable=True)  # torch.save writes front to back
    return written


def _unsafe_error(path: str, err: BaseException) -> UnsafeCheckpointError:
    names = sorted(set(GLOBAL_RE.findall(str(err))))
    what = ", ".join(names) if names else "a Python object outside torch's allowlist"
    return UnsafeCheckpointError(
        f"{path} needs {what} to load, which could run arbitrary code, so it was refused and nothing "
        "was executed. Only for a file you trust: pass weights_only=False (or allowlist the type with "
        "torch.serialization.add_safe_globals)"
    )


def _missing_class(err: BaseException) -> str | None:
    """What an unpickler could not import, from its error (None: some other failure)."""
    if isinstance(err, ModuleNotFoundError) and err.name:
        return f"module {err.name!r}"
    found = re.match(r"Can't get attribute '([^']+)' on <module '([^']+)'", str(err))
    return f"{found.group(2)}.{found.group(1)}" if found else None


def load_file(
    path: PathLike,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
    mmap: bool = False,
    pickle_module: Any = None,
    crc: bool = False,
) -> Any:
    """``torch.load`` a local path or URL, turning failures into ckptools errors.

    The file is opened once (`ckptools.storage.open_for_read`): ckptools' checks (with ``crc``,
    every record's CRC-32 too, in the same pass: `verify_torch_file`), torch's reader and the
    mapping of its storages all read that one open file, so a file put at ``path`` meanwhile is
    never half read. ``mmap`` maps a local zip (a legacy or remote file is read). ``pickle_module``
    (with ``weights_only=False``) is passed to ``torch.load``: the placeholder reader of
    `ckptools.layouts.placeholders.load_without_code`. With ``weights_only`` every file is read by
    torch's own weights-only unpickler: there is no other way in.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsafeCheckpointError: ``weights_only=True`` and the file needs arbitrary globals.
        CheckpointFormatError: the file is empty, truncated, corrupt or not a torch file.
        CheckpointLayoutError: a valid file of another kind, or no regular file (a named pipe).
    """
    handle, local = open_for_read(path)  # a Location is used as resolved, not parsed again
    with handle:
        return load_open(
            handle, fspath(path), local=local, map_location=map_location, weights_only=weights_only, mmap=mmap,
            pickle_module=pickle_module, crc=crc,
        )  # fmt: skip


def load_open(
    handle: IO[bytes],
    path: str,
    *,
    local: bool,
    map_location: Any = "cpu",
    weights_only: bool = True,
    mmap: bool = False,
    pickle_module: Any = None,
    crc: bool = False,
) -> Any:
    """`load_file` of a file already open (``handle``, from `ckptools.storage.open_for_read`; ``path``
    names it in messages): for a reader that read part of it first, so that both reads are of one file."""
    # torch allocates what a file claims (a zip record's size, a legacy storage's numel) before
    # reading it: a 4 GiB claim in a 1 KiB file would be allocated. Claims are checked first. A
    # mapped load allocates nothing: each storage is a slice of the mapping, checked against its
    # record as torch takes it (`_Claimed`), and ckptools' own parse of the pickle (~40 % of what
    # reading a snapshot of 131 tensors costs) runs only if torch's unpickler refuses, to name why.
    head = handle.read(512)
    zipped = head[:4] == ZIP_MAGIC
    mapped = mmap and local and zipped and _mappable(handle, weights_only, pickle_module)
    refusal, archive = None, None
    if zipped:
        # A file mapped for the load is checksummed where the load reads it (`_torchs_mmap_branch`).
        archive, refusal = _scan_zip(path, handle, crc=crc and not mapped, parse=not mapped)
        kind = None
    else:
        kind = other_kind(head)
    if kind is not None:  # a valid file of another kind: said what it is, never "corrupt"
        raise CheckpointLayoutError(f"{path} is not a torch checkpoint: it is {kind}")
    if not zipped and crc:  # the legacy format has no checksums: refused as verify_torch_file does
        _scan_zip(path, handle, crc=True)
    if not zipped and weights_only:  # a trusted file is left to torch entirely
        check_non_zip(handle, handle.seek(0, 2), path)
    handle.seek(0)
    import torch  # only now: a file refused above is refused without it (a second saved for `ckpt`)

    if weights_only and pickle_module is None and archive is not None and _protocol(handle, archive) > 2:
        return _load_transcoded(handle, archive, map_location)  # torch's weights-only unpickler reads protocol 2
    try:
        if mapped:  # only local zip files: storages are mapped, read when touched
            assert archive is not None  # zipped: scanned above
            return _torchs_mmap_branch(handle, archive, map_location, _unpickler(weights_only, pickle_module), crc=crc)
        extra = {} if pickle_module is None else {"pickle_module": pickle_module}
        return torch.load(handle, map_location=map_location, weights_only=weights_only, **extra)
    except CheckpointError:
        raise
    except Exception as err:
        if mapped and archive is not None:  # ckptools' parse, not made before: it names what is wrong
            try:
                refusal = _scan_zip(path, handle, crc=False)[1]
            except CheckpointError as found:
                raise found from err
        failure = _failure(path, err, weights_only)
        if type(failure) is UnsafeCheckpointError and "BUILD" in str(failure) and refusal is not None:
            failure = refusal  # ckptools' reader names the global the file reached for
        raise failure from err


def _newer_protocol(err: BaseException) -> bool:
    """Whether torch's weights-only unpickler stopped at an opcode of pickle protocol 4 or 5
    (``torch.save(..., pickle_protocol=4)``: FRAME, MEMOIZE, STACK_GLOBAL, ...), which it does not read."""
    return isinstance(err, pickle.UnpicklingError) and "Unsupported operand" in str(err)


def _protocol(handle: IO[bytes], archive: TorchZip) -> int:
    """The pickle protocol ``data.pkl`` begins with (its PROTO opcode; 0 without one)."""
    handle.seek(archive.starts[archive.pkl_index])
    head = handle.read(2)
    handle.seek(0)  # torch's loaders read the file from where the handle is
    return head[1] if len(head) == 2 and head[0] == pickle.PROTO[0] else 0


def _load_transcoded(handle: IO[bytes], archive: TorchZip, map_location: Any) -> Any:
    """A zip whose ``data.pkl`` is pickle protocol 4 or 5, loaded weights-only all the same.

    The file is valid: ``torch.save(obj, f, pickle_protocol=4)`` wrote it, and the newer opcodes
    only frame, memoize and name globals (none runs anything). ckptools' strict reader parses it
    (a refused global is refused here, as torch would), the tree is written back as protocol 2,
    and torch's own weights-only unpickler reads that, through torch's zip loader: every judgment
    torch makes of a file is made of this one too. ``archive``: the zip ``handle`` holds open.
    """
    import io
    import types

    import torch.serialization as ts
    from torch._weights_only_unpickler import Unpickler as Safe

    from ..codecs.pickle_writer import dumps

    path = archive.path  # the zip ``handle`` holds open, its directory read already (`_scan_zip`)
    data = dumps(loads(archive.read_pickle(handle), path, archive))

    class Unpickler(Safe):
        def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
            super().__init__(io.BytesIO(data), **kwargs)  # the protocol-2 copy of what ``file`` holds

    handle.seek(0)
    try:
        with ts._open_zipfile_reader(handle) as reader:
            unpickler = types.SimpleNamespace(Unpickler=Unpickler)
            return ts._load(reader, map_location, unpickler, encoding="utf-8")  # type: ignore[no-untyped-call]
    except CheckpointError:
        raise
    except Exception as err:
        raise _failure(path, err, True) from err


def _failure(path: str, err: Exception, weights_only: bool) -> CheckpointError:
    """The ckptools error for what ``torch.load`` of ``path`` raised."""
    if isinstance(err, pickle.UnpicklingError):
        if weights_only and "GLOBAL" in str(err):
            return _unsafe_error(path, err)
        built = re.search(r"Can only build .*but got <class '([^']+)'>", str(err))
        if weights_only and built:  # a BUILD onto a global (a class, a function): refused by torch's unpickler
            return UnsafeCheckpointError(build_refusal(path, f"a {built.group(1)}"))
        if _cuda_without_cuda(err):  # torch < 2.6 wraps it in its weights-only loader's error
            return _cuda_error(path)
        if weights_only and _newer_protocol(err):  # a legacy (non-zip) file: only a zip is transcoded
            return CheckpointFormatError(
                f"{path} was pickled with protocol 4 or 5 in torch's legacy format, which torch's weights-only "
                "reader does not read; the file is not damaged: re-save it with torch.save's defaults, or, only "
                "for a file you trust, load it with weights_only=False (--trust-code)"
            )
        return CheckpointFormatError(f"{path} is corrupt or not a torch checkpoint ({first_line(err)})")
    if isinstance(err, (ModuleNotFoundError, AttributeError)):
        missing = _missing_class(err)
        if weights_only or missing is None:
            return CheckpointFormatError(
                f"{path} is truncated, corrupt or not a torch checkpoint ({first_line(err)}); "
                "re-save it or pick another file"
            )
        # An intact file whose pickled class lives in a module this environment lacks: not damage.
        return MissingClassError(
            f"{path} names {missing}, which cannot be imported here ({first_line(err)}); the file is intact: "
            "install the module that defines it, or read the weights without trusting the file (drop "
            "--trust-code / weights_only=False), which stands inert placeholders in for such classes"
        )
    if isinstance(err, OSError):
        return CheckpointFormatError(f"{path} could not be read ({err})")
    # On a damaged file torch.load raises whatever its reader tripped over: RuntimeError from the
    # zip reader, EOFError, KeyError, struct.error and even AssertionError from the legacy reader
    # (found by fuzzing). All of them mean the same thing to the caller.
    if isinstance(err, RuntimeError) and _cuda_without_cuda(err):
        return _cuda_error(path)
    reason = "it is empty or truncated" if isinstance(err, EOFError) else first_line(err)
    return CheckpointFormatError(
        f"{path} is truncated, corrupt or not a torch checkpoint ({reason}); re-save it or pick another file"
    )


# torch.serialization's pieces of its own mmap branch (torch 2.6 to 2.14), which `_torchs_mmap_branch` runs.
_MMAP_PIECES = ("_open_zipfile_reader", "_load", "get_default_mmap_options", "MAP_SHARED")


def _unpickler(weights_only: bool, pickle_module: Any) -> Any:
    """The ``pickle_module`` torch.load itself would unpickle with: its weights-only one, or the caller's."""
    import torch.serialization as ts

    return getattr(ts, "_weights_only_unpickler", None) if weights_only else pickle_module or pickle


def _mappable(handle: IO[bytes], weights_only: bool, pickle_module: Any) -> bool:
    """Whether the file ``handle`` holds open can be loaded mapped by torch's own mmap branch: this
    torch has its pieces and the system a name for the open file (`ckptools.storage.mapped_path`).
    Where not, it is read through ``handle`` (torch.load), unmapped."""
    import torch.serialization as ts

    pieces = all(getattr(ts, name, None) is not None for name in _MMAP_PIECES)
    return pieces and _unpickler(weights_only, pickle_module) is not None and mapped_path(handle) is not None


def _torchs_mmap_branch(
    handle: IO[bytes], archive: TorchZip, map_location: Any, pickle_module: Any, *, crc: bool = False
) -> Any:
    """torch.load's own mmap branch (torch 2.6 to 2.14: its zip reader, the file mapped whole, its
    ``_load`` with ``pickle_module``) on the file ``handle`` holds open (`_mappable` said it can be),
    every storage torch takes of the mapping checked against ``archive``'s records (`_Claimed`), and
    with ``crc`` every record's CRC-32 first, from the mapping itself: the pages the load then copies
    are read once (through a buffer first, a restore from node memory read them twice).

    ``handle`` is buffered by `ckptools.storage.open_local`: torch opens a file with Python's default
    buffer, the filesystem's block size, and reads each storage's local header after a seek (on a tmpfs
    with huge pages, 2 MiB blocks, a restore of 131 tensors from node memory spent 13 ms there; on Lustre
    or GPFS, 4-16 MiB, it is worse). The mapping is of the open file itself (`mapped_path`), never of
    whatever is at its path now.
    """
    import torch
    import torch.serialization as ts

    from ..devices import registered_with_cuda  # imports torch: a file is read without it elsewhere

    open_reader, load, mmap_options, map_shared = (getattr(ts, name) for name in _MMAP_PIECES)
    handle.seek(0)
    with open_reader(handle) as reader:
        shared = os.name != "nt" and mmap_options() == map_shared
        size = os.fstat(handle.fileno()).st_size
        overall = torch.UntypedStorage.from_file(mapped_path(handle), shared, size)
        if crc:  # every record lies inside the file (`TorchZip`): no page past its end is read
            mapped = torch.empty(0, dtype=torch.uint8).set_(overall).numpy()  # type: ignore[arg-type]
            _check_crcs(archive.path, handle, archive, mapped=mapped)
        try:
            with registered_with_cuda(overall, map_location):  # host-to-device copies at pinned speed
                return load(reader, map_location, pickle_module, overall_storage=_Claimed(overall, archive),
                            encoding="utf-8")  # fmt: skip
        except BaseException:
            tls = getattr(ts, "_serialization_tls", None)
            if tls is not None:  # torch's _load leaves it set when a load fails (reset only on success)
                tls.map_location = None
            raise


class _Claimed:
    """The mapped file as torch's ``_load`` sees it: each storage it slices off (``overall[start:end]``,
    its only use) must be one record's data, whole. A pickle that claims more bytes than its record
    holds would make torch read the next record's bytes as its own, silently: what ckptools' parse of
    the pickle checked before a load (`TorchZip.check_storages`), checked here as torch takes them."""

    def __init__(self, storage: Any, archive: TorchZip) -> None:
        self._storage = storage
        self._path = archive.path
        self._records: dict[int, tuple[str, int]] = {}
        for name, (start, size) in archive.records.items():
            if name.startswith("data/") and size >= self._records.get(start, ("", -1))[1]:
                self._records[start] = (name, size)

    def __getitem__(self, where: Any) -> Any:
        if isinstance(where, slice):
            record = self._records.get(where.start)
            if record is None:
                raise CheckpointFormatError(f"{self._path}: a storage starts at byte {where.start}, where no record's "
                                            "data does (corrupt file); pick an earlier checkpoint")  # fmt: skip
            if where.stop - where.start > record[1]:
                raise CheckpointFormatError(
                    f"{self._path}: record {record[0]} holds {record[1]} bytes, but its storage has "
                    f"{where.stop - where.start} (truncated or corrupt file)"
                )
        return self._storage[where]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def _cuda_without_cuda(err: BaseException) -> bool:
    """Whether torch refused to put a storage on a CUDA device this machine lacks."""
    text = str(err)
    return "CUDA" in text and "deserialize" in text


def _cuda_error(path: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path} holds CUDA tensors but CUDA is not available here; load it with map_location='cpu'"
    )


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    # torch's messages run on for paragraphs; the first sentence says what happened.
    return f"{type(err).__name__}: {text[0].split('. ')[0][:200]}" if text else type(err).__name__


def verify_torch_file(path: PathLike) -> None:
    """Check every record of a torch zip checkpoint against its stored CRC-32.

    ``torch.load`` does not check CRCs, so a flipped bit in tensor data loads silently. This
    reads the whole file once. Legacy (pre-1.6, non-zip) files carry no checksums and cannot be
    verified: they raise `CheckpointFormatError`.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointFormatError: the file is truncated, a record is damaged, or it is not a zip
            torch checkpoint.
    """
    handle, _ = open_for_read(path)  # a Location is used as resolved, not parsed again
    path = fspath(path)
    with handle:
        _scan_zip(path, handle, crc=True)


def _scan_zip(
    path: str, handle: IO[bytes], *, crc: bool, parse: bool = True
) -> tuple[TorchZip, UnsafeCheckpointError | None]:
    """Check a torch zip as torch's reader would (container, small records, ``data.pkl``'s CRC-32,
    and with ``parse`` every storage the pickle names present and whole), and each record's CRC-32
    with ``crc``; the archive. What ckptools' own reader refused is returned, not raised: torch's
    loader decides (a class the user allowlisted, a trusted file), and the refusal names what it
    refused where torch's words say less."""
    try:
        archive = TorchZip(path, handle)
        if crc:
            _check_crcs(path, handle, archive)
        data = archive.read_pickle(handle)  # its CRC-32 checked: torch checks none
        if parse:
            try:
                loads(data, path, archive)
            except UnsafeCheckpointError as refusal:
                return archive, refusal
        return archive, None
    except (OSError, EOFError, ValueError, zlib.error, NotImplementedError, struct.error) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointFormatError(f"{path} is damaged ({first_line(err)}); pick an earlier checkpoint") from err


def _check_crcs(
    path: str, handle: IO[bytes], archive: TorchZip, starts: set[int] | None = None, *, mapped: Any = None
) -> None:
    """Each record's CRC-32 (those whose data begins at ``starts``, or all), read from ``handle``, or from
    ``mapped``, the file's bytes already mapped (every record lies inside the file: `TorchZip`)."""
    for info, start in zip(archive.infos, archive.starts):
        # torch stores every record uncompressed, so its CRC-32 can be checked straight from the
        # file in large reads (zipfile's own reader checks it too, but ~4x slower).
        if starts is not None and start not in starts:
            continue
        if mapped is not None:
            found = crc32_mapped(mapped, start, info.file_size)
        else:
            found = crc32_range(handle, start, info.file_size, what=f"{path}: record {info.filename}")
        if found != info.CRC:
            raise damaged_record(path, info.filename)


def check_records(location: Location, starts: list[int]) -> None:
    """Check the CRC-32 of the records of a local torch zip whose data begins at ``starts`` (one open)."""
    handle, _ = open_for_read(location)
    with handle:
        _check_crcs(location.url, handle, TorchZip(location.url, handle), set(starts))


def damaged_record(path: str, name: str) -> CheckpointFormatError:
    """The error of a record whose bytes do not match its CRC-32."""
    return CheckpointFormatError(
        f"{path}: record {name} is damaged (CRC-32 mismatch: bit rot or a partial write); pick an earlier checkpoint"
    )
