"""The torch adapter: the one place a torch checkpoint file becomes objects, and objects one.

``torch.load`` runs with ``weights_only=True`` unless the caller opts out, and torch's assorted
errors (RuntimeError from miniz, UnpicklingError, EOFError, ...) are turned into
`CheckpointFormatError` or `UnsafeCheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from ..codecs.legacy import check_non_zip
from ..codecs.pickles import loads
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
    crc32_range,
    fspath,
    open_for_read,
    open_headers,
    own_node_memory,
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

    The file is opened once for ckptools' checks (with ``crc``, every record's CRC-32 too, in the
    same pass: `verify_torch_file`), and once more by torch. ``mmap`` maps a local zip (a legacy or
    remote file is read). ``pickle_module`` (with ``weights_only=False``) is passed to
    ``torch.load``: the placeholder reader of `ckptools.layouts.placeholders.load_without_code`.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsafeCheckpointError: ``weights_only=True`` and the file needs arbitrary globals.
        CheckpointFormatError: the file is empty, truncated, corrupt or not a torch file.
    """
    source, local = open_for_read(path)  # a Location is used as resolved, not parsed again
    path = fspath(path)
    if mmap and local and weights_only and pickle_module is None and not crc and own_node_memory(source):
        try:  # this user's own snapshot: read as trusted as the process's memory (`_load_own`)
            tree = _load_own(source, map_location)
        except Exception:  # noqa: BLE001 - damaged, or a valid file of another kind: the checked path says which
            tree = _UNLISTED
        if tree is not _UNLISTED:
            return tree
    # torch allocates what a file claims (a zip record's size, a legacy storage's numel) before
    # reading it: a 4 GiB claim in a 1 KiB file would be allocated. Claims are checked first.
    with _opened(source, local) as handle:
        head = handle.read(512)
        zipped = head[:4] == ZIP_MAGIC
        if zipped:
            _scan_zip(path, handle, crc=crc)
            kind = None
        else:
            kind = other_kind(head)
        if kind is not None:  # a valid file of another kind: said what it is, never "corrupt"
            raise CheckpointLayoutError(f"{path} is not a torch checkpoint: it is {kind}")
        if not zipped and crc:  # the legacy format has no checksums: refused as verify_torch_file does
            _scan_zip(path, handle, crc=True)
        if not zipped and weights_only:  # a trusted file is left to torch entirely
            check_non_zip(handle, handle.seek(0, 2), path)
    mmap = mmap and local and zipped
    import torch  # only now: a file refused above is refused without it (a second saved for `ckpt`)

    try:
        extra = {} if pickle_module is None else {"pickle_module": pickle_module}
        if mmap:  # only for local zip files: storages are mapped, read when touched
            return _mapped_load(source, map_location, weights_only, extra)
        return torch.load(source, map_location=map_location, weights_only=weights_only, **extra)
    except CheckpointError:
        raise
    except Exception as err:
        raise _failure(path, err, weights_only) from err


def _failure(path: str, err: Exception, weights_only: bool) -> CheckpointError:
    """The ckptools error for what ``torch.load`` of ``path`` raised."""
    if isinstance(err, pickle.UnpicklingError):
        if weights_only and "GLOBAL" in str(err):
            return _unsafe_error(path, err)
        if _cuda_without_cuda(err):  # torch < 2.6 wraps it in its weights-only loader's error
            return _cuda_error(path)
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
            "--trust-code / trust_code=True), which stands inert placeholders in for such classes"
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


# What `_load_own` returns for a file that names a global outside torch's allowlist.
_UNLISTED = object()


class _Unlisted(Exception):
    """A global outside torch's weights-only allowlist: `_load_own` leaves the file to the checked path."""


def _load_own(path: str, map_location: Any) -> Any:
    """A snapshot in this user's own node memory (`ckptools.storage.own_node_memory`), read with
    torch's weights-only allowlist on the C unpickler, without ckptools' checks of its claims.

    The checked path costs 13 ms for a snapshot of 131 tensors (ckptools' pickle scan 3.5 ms,
    torch's pure-Python weights-only unpickler 9 ms), 20 % of a 1 GiB restore's copy: those checks
    guard against a file made to attack its reader (claims that allocate, a memo index that makes
    the C unpickler allocate gigabytes), and this file was written by this user's own job into a
    folder nobody else can write. The allowlist stays: a global outside it returns `_UNLISTED`, and
    the caller reads the file the checked way (torch's refusal, or a global added by the user), as it
    does a file this reader fails on (the checked path names the damage, or the file's other kind).
    """
    import torch.serialization as ts

    lists = getattr(ts, "_weights_only_unpickler", None)
    if lists is None or not hasattr(lists, "_get_user_allowed_globals"):
        return _UNLISTED  # another torch's internals: the checked path
    allowed = {**lists._get_allowed_globals(), **lists._get_user_allowed_globals()}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed.get(f"{module}.{name}")
            if found is None:
                raise _Unlisted(f"{module}.{name}")
            return found

    module = type(pickle)("ckptools_allowlisted_pickle")
    module.Unpickler = Unpickler  # type: ignore[attr-defined]  # all torch's _load takes of a pickle_module
    try:
        tree = _torchs_mmap_branch(path, map_location, module)
    except BaseException as err:
        tls = getattr(ts, "_serialization_tls", None)
        if tls is not None:  # torch's _load left it set (it is reset only when a load succeeds)
            tls.map_location = None
        if isinstance(err, _Unlisted):
            return _UNLISTED
        raise
    return _UNLISTED if tree is _TORCH_LOAD else tree


def _mapped_load(path: str, map_location: Any, weights_only: bool, extra: dict[str, Any]) -> Any:
    """``torch.load(path, mmap=True)``, its zip reader on a file buffered by `open_headers`.

    torch opens the file with Python's default buffer, the filesystem's block size, and reads each
    storage's local header after a seek: on a tmpfs with huge pages (2 MiB blocks) a restore of 131
    tensors from node memory spent 13 ms there, on Lustre or GPFS (4-16 MiB) it is worse. This is
    torch.load's own mmap branch (`_torchs_mmap_branch`) on a smaller buffer; where torch lacks a
    piece of it, torch.load itself.
    """
    import torch
    import torch.serialization as ts

    safe_unpickler = getattr(ts, "_weights_only_unpickler", None)
    unpickler = safe_unpickler if weights_only else extra.get("pickle_module", pickle)
    tree = _TORCH_LOAD if unpickler is None else _torchs_mmap_branch(path, map_location, unpickler)
    if tree is _TORCH_LOAD:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True, **extra)
    return tree


# What `_torchs_mmap_branch` returns where torch.load itself must read the file.
_TORCH_LOAD = object()


def _torchs_mmap_branch(path: str, map_location: Any, pickle_module: Any) -> Any:
    """torch.load's own mmap branch (torch 2.6 to 2.14: its zip reader, the file mapped whole, its
    ``_load`` with ``pickle_module``) on a file opened by `open_headers`; `_TORCH_LOAD` where this
    torch lacks a piece of it, or for TorchScript (torch.load's own answer: a warning, or its refusal)."""
    import torch
    import torch.serialization as ts

    names = ("_open_zipfile_reader", "_is_torchscript_zip", "_load", "get_default_mmap_options", "MAP_SHARED")
    parts: list[Any] = [getattr(ts, name, None) for name in names]
    if any(part is None for part in parts):  # another torch's internals: its own load, on its own buffer
        return _TORCH_LOAD
    open_reader, is_torchscript, load, mmap_options, map_shared = parts
    with open_headers(path) as handle, open_reader(handle) as reader:
        if is_torchscript(reader):
            return _TORCH_LOAD
        shared = os.name != "nt" and mmap_options() == map_shared
        overall = torch.UntypedStorage.from_file(path, shared, os.path.getsize(path))
        return load(reader, map_location, pickle_module, overall_storage=overall, encoding="utf-8")


def _cuda_without_cuda(err: BaseException) -> bool:
    """Whether torch refused to put a storage on a CUDA device this machine lacks."""
    text = str(err)
    return "CUDA" in text and "deserialize" in text


def _cuda_error(path: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{path} holds CUDA tensors but CUDA is not available here; load it with map_location='cpu'"
    )


@contextmanager
def _opened(source: Any, local: bool) -> Iterator[IO[bytes]]:
    """A binary handle on what `open_for_read` returned: a path is opened and closed, an
    in-memory copy of a remote file is rewound for the reader that comes next."""
    handle: IO[bytes] = open_headers(source) if local else source
    try:
        handle.seek(0)
        yield handle
    finally:
        if local:
            handle.close()
        else:
            handle.seek(0)


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
    source, local = open_for_read(path)  # a Location is used as resolved, not parsed again
    path = fspath(path)
    with _opened(source, local) as handle:
        _scan_zip(path, handle, crc=True)


def _scan_zip(path: str, handle: IO[bytes], *, crc: bool) -> None:
    """Check a torch zip as torch's reader would (container, small records, every storage the
    pickle names present and whole), and each record's CRC-32 with ``crc``."""
    try:
        archive = TorchZip(path, handle)
        if crc:
            _check_crcs(path, handle, archive)
        # A refused class: torch's own loader decides (an allowlisted class, or a trusted file).
        with contextlib.suppress(UnsafeCheckpointError):
            loads(archive.read_pickle(handle), path, archive)
    except (OSError, EOFError, ValueError, zlib.error, NotImplementedError, struct.error) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointFormatError(f"{path} is damaged ({first_line(err)}); pick an earlier checkpoint") from err


def _check_crcs(path: str, handle: IO[bytes], archive: TorchZip, starts: set[int] | None = None) -> None:
    """Each record's CRC-32 (those whose data begins at ``starts``, or all), read from ``handle``."""
    for info, start in zip(archive.infos, archive.starts):
        # torch stores every record uncompressed, so its CRC-32 can be checked straight from the
        # file in large reads (zipfile's own reader checks it too, but ~4x slower).
        if starts is not None and start not in starts:
            continue
        if crc32_range(handle, start, info.file_size, what=f"{path}: record {info.filename}") != info.CRC:
            raise damaged_record(path, info.filename)


def check_records(location: Location, starts: list[int]) -> None:
    """Check the CRC-32 of the records of a local torch zip whose data begins at ``starts`` (one open)."""
    with open(location.path, "rb") as handle:
        _check_crcs(location.url, handle, TorchZip(location.url, handle), set(starts))


def damaged_record(path: str, name: str) -> CheckpointFormatError:
    """The error of a record whose bytes do not match its CRC-32."""
    return CheckpointFormatError(
        f"{path}: record {name} is damaged (CRC-32 mismatch: bit rot or a partial write); pick an earlier checkpoint"
    )
