"""The weights of any layout as safetensors specs: what ``ckpt convert`` and `export_huggingface` write.

A local torch zip is the fast path: each tensor's bytes are copied straight out of its zip record
(torch is not imported); any other source is read once, through its layout.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

from ..codecs.dtypes import ITEMSIZE, STORAGE_TO_SAFETENSORS
from ..codecs.pickles import loads
from ..codecs.record import META_KEY
from ..codecs.safetensors import Spec, write_specs
from ..codecs.torchzip import TorchZip, open_local_zip
from ..codecs.trees import locate_weights, simple_tensor
from ..errors import CheckpointFormatError, UnsafeCheckpointError
from ..storage import Location, PathLike, crc32_range
from .base import Layout, Transform
from .safetensors_file import tensor_specs
from .torch_file import TORCH_FILE, load_torch

__all__ = ["Planned", "safetensors_plan"]


@dataclass
class Planned:
    """The safetensors to write: specs by name (the checkpoint's order), ``{dropped: kept}`` of
    tied names, and string metadata."""

    specs: dict[str, Spec]
    aliases: dict[str, str]
    metadata: dict[str, str]
    # The local zip the specs copy from, open once (`close` closes it): its pickle was read from it.
    source: IO[bytes] | None = None

    def __enter__(self) -> Planned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file the specs copy from (a local zip's; nothing for other sources)."""
        if self.source is not None:
            self.source.close()

    def nbytes(self, name: str) -> int:
        """The bytes of tensor ``name``'s data."""
        return self.specs[name].nbytes

    def write(self, path: PathLike, names: list[str] | None = None, metadata: Mapping[str, str] | None = None) -> str:
        """Write the tensors ``names`` (all by default; with their tied names) as one safetensors
        file, atomically, with this plan's metadata and ``metadata``; the path."""
        kept = set(self.specs if names is None else names)
        specs = {n: s for n, s in self.specs.items() if n in kept}
        aliases = {a: t for a, t in self.aliases.items() if t in kept}
        return write_specs(path, specs, aliases, {**self.metadata, **dict(metadata or {})})


def safetensors_plan(
    location: Location, layout: Layout, *, key: str | None, transform: Transform, trust_code: bool
) -> Planned:
    """What to write for the weights at ``location`` (any layout), renamed by ``transform``:
    specs, aliases (the first of tied names in the checkpoint's own order is kept, as
    transformers expects) and metadata (``format: pt``, the top-level scalars of a torch file)."""
    src = location.url
    torch_file = layout is TORCH_FILE and not trust_code
    opened = open_local_zip(location) if torch_file else None
    if opened is not None:
        # Fast path: tensors are copied straight out of their zip records, torch is not needed. The
        # file is opened once: the pickle read and every record copied come from the same file.
        archive, handle = opened
        try:
            try:
                tree = loads(archive.read_pickle(handle), src, archive)
            except UnsafeCheckpointError:
                tree = None  # other entries need refused classes: the lenient path below
            if tree is not None:
                _, _, parsed = locate_weights(tree, key=key, path=src)
                weights = transform(parsed)
                planned = _zip_specs(archive, handle, weights)
                if planned is not None:
                    meta = {"format": "pt", **(_scalars(tree) if isinstance(tree, Mapping) else {})}
                    return Planned(planned[0], planned[1], meta, source=handle)
        except BaseException:
            handle.close()
            raise
        handle.close()
    meta = {"format": "pt"}
    tree = None
    if torch_file:
        with contextlib.suppress(UnsafeCheckpointError):  # then read_weights reads the weights without code
            tree = load_torch(location)  # read once: the weights and the scalar entries (epoch, step)
    if tree is not None:
        import torch  # loaded by now (a file refused above is refused without it)

        weights = locate_weights(tree, key=key, path=src, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]
        if isinstance(tree, Mapping):
            meta.update(_scalars(tree))
    else:
        weights = layout.read_weights(location, key=key, map_location="cpu", verify=False, trust_code=trust_code)
    weights = dict(transform(dict(weights)))
    specs, aliases = tensor_specs(weights)
    return Planned(specs, aliases, meta)


def _scalars(ckpt: Mapping[str, Any]) -> dict[str, str]:
    """Top-level plain values (epoch, step, ...) as JSON strings, including ckptools' own metadata."""
    out: dict[str, str] = {}
    sources = [ckpt]
    meta = ckpt.get(META_KEY)
    if isinstance(meta, Mapping) and isinstance(meta.get("metadata"), Mapping):
        sources.insert(0, meta["metadata"])
    for source in sources:
        for key, value in source.items():
            if isinstance(key, str) and key != META_KEY and (value is None or type(value) in (int, float, str, bool)):
                out[key] = json.dumps(value)
    return out


def _zip_specs(
    archive: TorchZip, handle: IO[bytes], weights: Mapping[str, Any]
) -> tuple[dict[str, Spec], dict[str, str]] | None:
    """Specs that copy each tensor's bytes straight out of its zip record, read through ``handle``
    (the file ``archive`` was read from), or None if one can't be.

    Of tied names the first in ``weights``' order is kept (see `tensor_specs`).

    Works for dense, contiguous tensors of a dtype safetensors knows (what state dicts hold);
    anything else (views with gaps, quantized, sparse) makes the caller go through torch.
    """
    if archive.byteorder != b"little":
        return None  # saved on a big-endian machine: torch swaps the bytes on load
    records = {name[len("data/") :]: record for name, record in archive.records.items() if name.startswith("data/")}
    specs: dict[str, Spec] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in weights:
        simple = simple_tensor(weights[name])
        if simple is None:
            return None
        storage, offset, shape, stride = simple
        dtype = STORAGE_TO_SAFETENSORS.get(storage.storage_type.name)
        if dtype is None or storage.key not in records:
            return None
        itemsize = ITEMSIZE[dtype]
        numel = 1
        for d in shape:
            numel *= d
        expected, step = [], 1
        for d in reversed(shape):
            expected.append(step)
            step *= d
        if numel > 1 and [s for s, d in zip(stride, shape) if d != 1] != [
            e for e, d in zip(expected[::-1], shape) if d != 1
        ]:
            return None  # not contiguous
        start, size = records[storage.key]
        begin, nbytes = start + offset * itemsize, numel * itemsize
        if nbytes and offset * itemsize + nbytes > size:  # a zero-size view may point anywhere
            raise CheckpointFormatError(
                f"{archive.path}: tensor {name!r} reaches past its storage record (corrupt file)"
            )
        identity = (storage.key, offset, tuple(shape), tuple(stride))
        if numel and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name

        def write(f: IO[bytes], begin: int = begin, nbytes: int = nbytes, name: str = name) -> int:
            return crc32_range(handle, begin, nbytes, what=f"{archive.path}: tensor {name!r}", out=f)

        specs[name] = Spec(dtype, list(shape), nbytes, write)
    return specs, aliases
