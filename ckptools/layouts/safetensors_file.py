"""One safetensors file: tensors in, tensors out, and the layout that opens, verifies and renames it.

The bytes (header, records, checksums) are ``codecs.safetensors``; this module is where torch
tensors meet them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from ..codecs.dtypes import TORCH_NAMES
from ..codecs.safetensors import (
    ALIAS_KEY,
    Spec,
    header_of,
    name_map,
    read_safetensors_header,
    rename_safetensors,
    verify_safetensors,
    write_chunks,
    write_specs,
)
from ..codecs.trees import locate_weights
from ..errors import CheckpointFormatError, CheckpointLayoutError
from ..state_dict import tensor_identity
from ..storage import Location, PathLike, mapped_path, open_for_read, resolve
from ..text import plural
from ..view import CheckpointView, TensorInfo, Verification
from .base import Layout, Transform

__all__ = ["load_safetensors", "save_safetensors", "tensor_specs"]


class SafetensorsFile(Layout):
    """A ``.safetensors`` file: bare weights, read by ckptools' strict header reader first."""

    name = "safetensors file"

    def open(self, location: Location, *, trust_code: bool = False) -> CheckpointView:
        path = location.url
        header, metadata, _, size = read_safetensors_header(location)
        tensors = [
            TensorInfo(name=n, dtype=TORCH_NAMES[e["dtype"]], shape=e["shape"],
                       bytes=e["data_offsets"][1] - e["data_offsets"][0])
            for n, e in sorted(header.items())
        ]  # fmt: skip
        aliases = name_map(path, metadata, ALIAS_KEY)  # validated: ckptools' own metadata is untrusted input too
        by_name = {t.name: t for t in tensors}
        for alias, target in sorted(aliases.items()):
            if target in by_name and alias not in by_name:  # stored once, listed under both names
                t = by_name[target]
                tensors.append(TensorInfo(alias, t.dtype, t.shape, t.bytes, shared=True))
        return CheckpointView(
            path=path, format="safetensors", tensors=tensors, metadata=dict(metadata), files=[path], file_bytes=size,
            layout=self, location=location, trust_code=trust_code,
        )  # fmt: skip

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        assert view.location is not None  # every view a layout opens has one
        return _weights(view.location, key, map_location)

    def verify(self, view: CheckpointView) -> Verification:
        assert view.location is not None
        checked = verify_safetensors(view.location)
        _load(view.location, "cpu")
        said = f"safetensors, {plural(len(view.tensors), 'tensor')}"
        if checked:
            return Verification(f"{said}, {checked} CRC-32s match")
        unchecked = {view.location.name: "structure checked; no checksums stored"}
        return Verification(f"{said}, structure checked", unchecked)

    def read_weights(
        self, location: Location, *, key: str | None, map_location: Any, verify: bool, trust_code: bool = False
    ) -> Mapping[str, Any]:
        if verify:
            verify_safetensors(location)
        return _weights(location, key, map_location)

    def write_weights(self, location: Location, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
        """A safetensors file; tied tensors stored once (see `save_safetensors`)."""
        save_safetensors(location, tensors, metadata=metadata)

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        """Only the header is rewritten; the tensor bytes are copied."""
        if key is not None:
            raise CheckpointLayoutError(
                f"{location.url} is a safetensors file of bare weights: it has no entries, so key= does not apply"
            )
        return rename_safetensors(location, dst, transform)


SAFETENSORS_FILE = SafetensorsFile()


def _weights(location: Location, key: str | None, map_location: Any) -> dict[str, Any]:
    if key is not None:  # a safetensors file has no entries to look in: a clear error
        return dict(locate_weights({}, key=key, path=location.url)[2])
    return _load(location, map_location)


def _load(location: Location, map_location: Any) -> dict[str, Any]:
    # The strict reader: duplicate names, overlapping offsets and the like are refused before
    # safetensors (which accepts some of them) decodes anything; aliases are re-tied.
    import torch

    tensors = load_safetensors(location)
    # A dict or callable map_location describes torch storage tags, which safetensors files do
    # not have: their tensors stay on CPU.
    if isinstance(map_location, torch.device) and map_location.type != "cpu":
        tensors = {k: v.to(map_location) for k, v in tensors.items()}
    return tensors


def torch_dtypes() -> dict[str, Any]:
    import torch

    return {st: getattr(torch, attr) for st, attr in TORCH_NAMES.items() if hasattr(torch, attr)}


def save_safetensors(path: PathLike, tensors: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None) -> str:
    """Write ``tensors`` as a safetensors file, one tensor at a time, atomically.

    Tied tensors (the same view of one storage) are stored once, under the first of their names
    in ``tensors``' order, and the dropped names recorded in ``ckptools.aliases``; each stored
    tensor's CRC-32 goes into ``ckptools.crc32`` so that `verify_safetensors` can detect bit
    rot later. Memory stays at one tensor's
    contiguous copy at most (none for tensors that are already contiguous on CPU).
    """
    specs, aliases = tensor_specs(tensors)
    return write_specs(path, specs, aliases, metadata)


def tensor_specs(tensors: Mapping[str, Any]) -> tuple[dict[str, Spec], dict[str, str]]:
    """Specs that write each tensor's bytes, and ``{dropped name: kept name}`` for tied tensors.

    Of tied names the first in ``tensors``' own order is kept: in a state dict that is the input
    embedding, not ``lm_head``, which is the name transformers ties *to* the embedding (keeping
    ``lm_head`` would leave ``from_pretrained`` a freshly initialised embedding).
    """
    import torch

    names = {dtype: name for name, dtype in torch_dtypes().items()}
    specs: dict[str, Spec] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in tensors:
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(
                f"entry {name!r} is a {type(t).__name__}, not a tensor; pass key=... to pick the weights"
            )
        if t.is_nested:
            raise CheckpointFormatError(
                f"tensor {name!r} is a nested tensor; safetensors stores dense tensors only (store its .unbind() parts)"
            )
        if t.layout != torch.strided:
            raise CheckpointFormatError(
                f"tensor {name!r} is {t.layout}; safetensors stores dense tensors only (call .to_dense())"
            )
        if t.device.type == "meta":
            raise CheckpointFormatError(
                f"tensor {name!r} is on the meta device: it has a shape but no values to write (saved from a model "
                "built without memory); load real weights into it first"
            )
        if t.dtype not in names:
            raise CheckpointFormatError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        identity = tensor_identity(t)  # None for an empty tensor: never an alias
        if identity is not None and identity in seen:
            aliases[name] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = name

        def write(f: IO[bytes], t: torch.Tensor = t) -> int:
            if sys.byteorder != "little":  # pragma: no cover - no big-endian machine to test on
                raise NotImplementedError("writing safetensors on a big-endian machine is not supported")
            # A conjugate or negative view's bytes are not its values: resolve them (a copy).
            flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
            if flat.numel() <= 1:  # one element may keep any stride, and view(uint8) needs stride 1
                flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
            data = flat.view(torch.uint8).numpy()
            return write_chunks(f, memoryview(data))  # type: ignore[arg-type]  # ndarray is a buffer

        specs[name] = Spec(names[t.dtype], list(t.shape), t.numel() * t.element_size(), write)
    return specs, aliases


def load_safetensors(path: PathLike) -> dict[str, Any]:
    """Load every tensor of a safetensors file on CPU, re-tying aliases recorded by ckptools."""
    import safetensors.torch

    location = resolve(path)
    path = location.url
    handle, local = open_for_read(location)  # once: the header checked and the tensors read are of one file
    with handle:
        _, metadata, _, _ = header_of(handle, path)  # strict checks first: clear errors, no huge allocations
        mapped = mapped_path(handle) if local else None  # the open file, mapped by the official reader
        try:
            if mapped is not None:
                tensors = safetensors.torch.load_file(mapped)
            else:
                handle.seek(0)
                tensors = safetensors.torch.load(handle.read())
        except (safetensors.SafetensorError, OSError, ValueError) as err:
            raise CheckpointFormatError(f"{path} is not a valid safetensors file ({err})") from err
    # safetensors gives every zero-size tensor the same data pointer, whatever its dtype, and
    # torch.save then refuses them ("view the same data as different types"): give each its own.
    import torch

    tensors = {k: torch.empty(v.shape, dtype=v.dtype) if v.numel() == 0 else v for k, v in tensors.items()}
    for alias, target in name_map(path, metadata, ALIAS_KEY).items():
        # Only names the file does not store: metadata never overrides a stored tensor.
        if target in tensors and alias not in tensors:
            tensors[alias] = tensors[target]
    return tensors
