"""The safetensors format without torch: a streaming writer, a strict header reader, checks, renames.

The format is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces to a multiple of 8), then the raw little-endian tensor bytes. ckptools
writes it itself, tensor by tensor, because ``safetensors.torch.save_file`` builds the whole
payload in memory; files are read back with the official library in tests. Turning tensors
into `Spec` values and files into tensors is ``layouts.safetensors_file``'s part.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import IO, Any

from ..errors import CheckpointFormatError
from ..storage import (
    PathLike,
    atomic_write,
    copy_range,
    crc32,
    crc32_range,
    fspath,
    open_for_read,
    report_progress,
    resolve,
)
from .dtypes import ITEMSIZE

# Metadata keys ckptools adds to the files it writes.
CRC_KEY = "ckptools.crc32"  # {tensor name: CRC-32 of its bytes as 8 hex digits}


ALIAS_KEY = "ckptools.aliases"  # {dropped name: stored name} for tied tensors stored once


# The official reader refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER = 100_000_000


_CHUNK = 16 << 20


class Spec:
    """One tensor to write: safetensors dtype, shape, byte count, and how to write its bytes."""

    __slots__ = ("dtype", "nbytes", "shape", "write")

    def __init__(self, dtype: str, shape: list[int], nbytes: int, write: Callable[[IO[bytes]], int]) -> None:
        self.dtype, self.shape, self.nbytes, self.write = dtype, shape, nbytes, write


def _header(specs: Mapping[str, Spec], metadata: Mapping[str, str], where: str) -> tuple[list[str], bytes]:
    # Widest dtypes first keeps every tensor aligned to its item size (the header is padded to 8).
    order = sorted(specs, key=lambda n: (-ITEMSIZE[specs[n].dtype], n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        spec = specs[name]
        header[name] = {"dtype": spec.dtype, "shape": spec.shape, "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = _encode_header(header, where)
    return order, raw


def _encode_header(header: Mapping[str, Any], where: str) -> bytes:
    """The header's JSON as UTF-8, padded to 8 bytes; a name that is not text refused."""
    try:
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        bad = next(n for n in header if not _utf8(n) or not _utf8(json.dumps(header[n], ensure_ascii=False)))
        raise CheckpointFormatError(
            f"{where}: tensor name {bad!r} holds a lone surrogate, which is not text: a safetensors header is "
            "UTF-8, so it cannot be written; rename the tensor (nothing was written)"
        ) from None
    return raw + b" " * (-len(raw) % 8)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def write_specs(
    path: PathLike, specs: Mapping[str, Spec], aliases: Mapping[str, str], metadata: Mapping[str, str] | None
) -> str:
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    # CRC-32s are 8 hex digits: the header's length is known before any tensor is read, so
    # the placeholders are overwritten in place once the data is written.
    meta[CRC_KEY] = json.dumps({name: "00000000" for name in sorted(specs)}, separators=(",", ":"))
    if aliases:
        meta[ALIAS_KEY] = json.dumps(dict(aliases), separators=(",", ":"), sort_keys=True)
    order, raw = _header(specs, meta, str(path))

    def write(f: IO[bytes]) -> None:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        crcs = {name: f"{specs[name].write(f):08x}" for name in order}
        meta[CRC_KEY] = json.dumps(dict(sorted(crcs.items())), separators=(",", ":"))
        _, final = _header(specs, meta, str(path))
        if len(final) != len(raw):  # pragma: no cover - fixed-width fields guarantee equality
            raise RuntimeError("safetensors header changed size while writing")
        f.seek(8)
        f.write(final)
        f.seek(0, os.SEEK_END)

    return atomic_write(path, write)


def write_chunks(f: IO[bytes], view: memoryview) -> int:
    crc = 0
    for start in range(0, len(view), _CHUNK):
        chunk = view[start : start + _CHUNK]
        crc = crc32(chunk, crc)
        f.write(chunk)
        report_progress(len(chunk))
    return crc


def read_safetensors_header(path: PathLike) -> tuple[dict[str, Any], dict[str, str], int, int]:
    """Read and validate a safetensors header without reading tensor data.

    Returns:
        ``(entries, metadata, data_start, file_size)``; entries map names to
        ``{"dtype", "shape", "data_offsets"}``.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointFormatError: header length absurd or past the end, invalid JSON, duplicate
            names, unknown dtype, offsets that overlap, leave gaps or run past the end, or
            shapes that do not match their byte ranges.
    """
    handle, _ = open_for_read(path)  # a Location is used as resolved, not parsed again
    with handle:
        return header_of(handle, fspath(path))


def header_of(handle: IO[bytes], path: str) -> tuple[dict[str, Any], dict[str, str], int, int]:
    """`read_safetensors_header` of a file already open (``handle``; ``path`` names it in messages):
    for a reader that reads its tensors next, from the same open file."""
    size = handle.seek(0, 2)
    handle.seek(0)
    head = handle.read(8)
    if len(head) < 8:
        raise CheckpointFormatError(f"{path} is too short to be a safetensors file ({size} bytes)")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER or n > size - 8:
        raise CheckpointFormatError(
            f"{path}: safetensors header claims {n} bytes but the file has {size - 8} after the length field "
            "(truncated or not a safetensors file)"
        )
    raw = handle.read(n)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointFormatError(f"{path}: safetensors header names {key!r} twice")
            out[key] = value
        return out

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointFormatError(f"{path}: safetensors header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: safetensors header is not a JSON object")
    # As the official reader: absent or null is no metadata; anything else must be a map of strings
    # ([] or "" are not "empty metadata").
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_len = size - 8 - n
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointFormatError(f"{path}: safetensors entry {name!r} is malformed")
        if set(entry) != {"dtype", "shape", "data_offsets"}:
            # The official reader ignores fields it does not know; a rewrite would drop them, and
            # a field from a newer format could change what the bytes mean: refused, said why.
            unknown = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
            raise CheckpointFormatError(
                f"{path}: safetensors entry {name!r} has fields ckptools does not know ({', '.join(unknown)}); "
                "a safetensors entry holds dtype, shape and data_offsets"
            )
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointFormatError(f"{path}: tensor {name!r} has an invalid shape {str(shape)[:80]}")
        extent = 1
        for d in shape:
            extent *= max(d, 1)
        if extent >= 2**63:  # torch sizes are int64: such a shape cannot be built, even holding no element
            raise CheckpointFormatError(f"{path}: tensor {name!r} has a shape {str(shape)[:80]} no tensor can have")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointFormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * ITEMSIZE[dtype]:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} has data_offsets {offsets} that do not fit its shape {shape} and dtype "
                f"{dtype} inside the {data_len}-byte data section (truncated or corrupt file)"
            )
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise CheckpointFormatError(f"{path}: tensor {name!r} {what} (corrupt safetensors file)")
        position = end
    if position != data_len:
        raise CheckpointFormatError(f"{path}: {data_len - position} bytes after the last tensor (corrupt file)")
    return header, metadata, 8 + n, size


def verify_safetensors(path: PathLike) -> int:
    """Validate a safetensors file's structure and, where ckptools stored them, its checksums.

    Returns:
        The number of tensors whose CRC-32 was checked (0 for files from other tools, which
        carry none: then only the structure is checked).

    Raises:
        CheckpointFormatError: the structure is invalid or a checksum does not match.
    """
    location = resolve(path)  # once: the reads below use it as resolved
    path = location.url
    handle, _ = open_for_read(location)  # once: the header and the tensors checked are of one file
    with handle:
        header, metadata, start, _ = header_of(handle, path)
        if CRC_KEY not in metadata:
            return 0
        try:
            expected = json.loads(metadata[CRC_KEY])
        except json.JSONDecodeError as err:
            raise CheckpointFormatError(f"{path}: {CRC_KEY} metadata is not valid JSON") from err
        if not isinstance(expected, dict) or set(expected) != set(header):
            raise CheckpointFormatError(f"{path}: {CRC_KEY} metadata does not list exactly the stored tensors")
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            crc = crc32_range(handle, start + begin, end - begin, what=f"{path}: tensor {name!r}")
            if f"{crc:08x}" != expected[name]:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} fails its CRC-32 check (bit rot or a partial copy); the file is damaged"
                )
    return len(header)


def rename_safetensors(src: PathLike, dst: PathLike, transform: Any) -> int:
    """Rename the tensors of a safetensors file without decoding them; return how many changed.

    Only the JSON header is rewritten (names, and the names inside ckptools' checksum and alias
    metadata); the data section is copied byte for byte (``copy_file_range`` between local
    files). ``transform`` maps ``{name: name}`` to ``{new name: old name}`` (e.g.
    `ckptools.strip_prefix`). Writing is atomic, so ``dst`` may be ``src``.

    Raises:
        CheckpointFormatError: the file is invalid, or two names would become one.
    """
    location = resolve(src)
    handle, _ = open_for_read(location)  # once: the header read and the data copied are of one file
    with handle:
        return _rename(handle, location.url, fspath(dst), transform)


def _rename(handle: IO[bytes], src: str, dst: str, transform: Any) -> int:
    header, metadata, start, size = header_of(handle, src)
    renamed = transform({name: name for name in header})
    if len(renamed) != len(header):
        raise CheckpointFormatError(f"{src}: renaming would give two tensors the same name; nothing was written")
    new_name = {old: new for new, old in renamed.items()}
    meta = dict(metadata)
    if CRC_KEY in meta:
        crcs = name_map(src, metadata, CRC_KEY)
        meta[CRC_KEY] = json.dumps({new_name.get(k, k): v for k, v in crcs.items()}, separators=(",", ":"))
    if ALIAS_KEY in meta:
        aliases = name_map(src, metadata, ALIAS_KEY)
        renamed_aliases = transform(dict(aliases.items()))
        meta[ALIAS_KEY] = json.dumps({k: new_name.get(v, v) for k, v in renamed_aliases.items()}, separators=(",", ":"))
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    new_header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    new_header.update({new_name[name]: entry for name, entry in entries})
    raw = _encode_header(new_header, f"{src} -> {dst}")

    def write(f: IO[bytes]) -> None:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        copy_range(handle, f, start, size - start)

    atomic_write(dst, write)
    return sum(1 for old, new in new_name.items() if old != new)


def name_map(path: str, metadata: Mapping[str, str], key: str) -> dict[str, str]:
    """ckptools' own metadata ``key`` (a JSON map of strings), validated like any untrusted input."""
    if key not in metadata:
        return {}
    try:
        value = json.loads(metadata[key])
    except ValueError as err:
        raise CheckpointFormatError(f"{path}: {key} metadata is not valid JSON ({err})") from err
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointFormatError(f"{path}: {key} metadata must map names to strings")
    return value
