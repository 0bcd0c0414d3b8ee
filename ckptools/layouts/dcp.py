"""A ``torch.distributed.checkpoint`` (DCP) folder: a pickled ``.metadata`` and ``*.distcp`` data files.

``.metadata`` is read by a restricted unpickler (torch reads it with ``pickle.load``, which would
run any code in it); tensors are read by torch's own DCP reader, without a process group. DCP
stores no checksums, and its names live in the pickle: no rename.
"""

from __future__ import annotations

import collections
import fnmatch
import importlib
import os
import pathlib
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..codecs.trees import locate_weights
from ..errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError, UnsafeCheckpointError
from ..storage import Location, open_local
from ..text import plural
from ..view import CheckpointView, TensorInfo, Verification
from .base import Layout, Transform


@dataclass
class _Opened:
    folder: str
    meta: Any
    files: list[str]


class DcpFolder(Layout):
    """A DCP folder, or its ``.metadata`` file. One ``.distcp`` shard alone is refused (`open`)."""

    name = "DCP folder"
    folder = True

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        name = location.name
        if name.endswith(".distcp"):
            folder = os.path.dirname(location.path) or "."
            if not location.fs.exists(location.path):
                raise CheckpointNotFoundError(f"{location.url} does not exist")
            raise CheckpointLayoutError(
                f"{location.url} is one shard of a torch.distributed.checkpoint (DCP) folder, not a checkpoint on "
                f"its own; pass the folder that holds it and its .metadata ({folder})"
            )
        folder = (os.path.dirname(location.path) or ".") if name == ".metadata" else location.path.rstrip("/") or "/"
        return _open(folder, self, location, trust_code)

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        import torch

        opened: _Opened = view.state
        tree = _dcp_tensors(opened.folder, opened.meta)
        found = locate_weights(tree, key=key, path=opened.folder, is_leaf=lambda v: isinstance(v, torch.Tensor))[2]
        if isinstance(map_location, torch.device) and map_location.type != "cpu":
            return {k: v.to(map_location) for k, v in found.items()}
        return dict(found)

    def verify(self, view: CheckpointView) -> Verification:
        opened: _Opened = view.state
        folder, files = opened.folder, opened.files
        missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
        if missing:
            raise CheckpointFormatError(f"{folder}: DCP data files {', '.join(missing[:5])} are missing")
        stray = sorted(set(fnmatch.filter(os.listdir(folder), "*.distcp")) - set(files))
        if stray:
            raise CheckpointFormatError(
                f"{folder}: stray DCP data files the .metadata does not name: {', '.join(stray[:5])}"
            )
        _dcp_tensors(folder, opened.meta)
        return Verification(
            f"DCP folder, {plural(len(files), 'data file')}, {plural(len(view.tensors), 'tensor')} read",
            {name: "every tensor read; DCP stores no checksums" for name in files},
        )

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        folder = location.path if os.path.isdir(location.path) else os.path.dirname(location.path)
        raise CheckpointLayoutError(
            f"{folder} is a DCP folder, whose names live in a pickled .metadata; convert it instead "
            f"(ckpt convert {folder} OUT.safetensors strips 'module.' by default)"
        )


DCP_FOLDER = DcpFolder()


def _open(folder: str, layout: DcpFolder, location: Location, trust_code: bool) -> CheckpointView:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = _dcp_metadata(folder)
    items = getattr(meta, "state_dict_metadata", None)
    if not isinstance(items, dict):
        raise CheckpointFormatError(f"{folder}/.metadata holds no state_dict_metadata (corrupt or not DCP)")
    tensors: list[TensorInfo] = []
    objects: list[str] = []
    for name, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for d in item.size:
                numel *= d
            dtype = item.properties.dtype
            tensors.append(TensorInfo(name, str(dtype).removeprefix("torch."), list(item.size),
                                      numel * dtype.itemsize))  # fmt: skip
        elif isinstance(item, BytesStorageMetadata):
            objects.append(name)
    files = sorted({info.relative_path for info in (getattr(meta, "storage_data", None) or {}).values()})
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files if os.path.exists(os.path.join(folder, f)))
    counted = _count_by_top(t.name for t in tensors)
    pickled = _count_by_top(objects)
    entries = {}
    for top in dict.fromkeys([*counted, *pickled]):
        parts = [plural(counted[top], "tensor")] if top in counted else []
        parts += [f"{pickled[top]} pickled values (not read)"] if top in pickled else []
        entries[top] = ", ".join(parts)
    return CheckpointView(
        path=folder, format="DCP folder (torch.distributed.checkpoint)", tensors=tensors, entries=entries,
        files=[os.path.join(folder, ".metadata"), *(os.path.join(folder, f) for f in files)], file_bytes=size,
        layout=layout, location=location, trust_code=trust_code, state=_Opened(folder, meta, files),
    )  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a plain pickle (torch reads it with ``pickle.load``, which would run
    any code in it): allow only DCP's own metadata classes and the plain types they hold."""

    _MODULES: ClassVar[tuple[str, ...]] = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint._extension",
    )

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum

        import torch

        if module in self._MODULES:
            found = getattr(importlib.import_module(module), name, None)
            # Their data classes and enums only: building one runs no code of the file's choosing.
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return _layout  # how torch pickles a torch.layout: by its name
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
            return pathlib.PurePosixPath  # StorageMeta.checkpoint_id; a pure path touches nothing
        elif module == "pathlib" and name in ("WindowsPath", "PureWindowsPath"):
            return pathlib.PureWindowsPath
        raise UnsafeCheckpointError(f"needs {module}.{name}")


def _layout(name: str) -> Any:
    import torch

    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise UnsafeCheckpointError(f"names a layout {name!r} torch does not have")
    return found


def _dcp_metadata(folder: str) -> Any:
    path = os.path.join(folder, ".metadata")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    with open_local(path) as f:
        try:
            return _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(
                f"{path} {err}, outside the classes a DCP .metadata file holds; refused, nothing was executed"
            ) from None
        except Exception as err:
            raise CheckpointFormatError(f"{path} is truncated or corrupt ({type(err).__name__}: {err})") from err


def _count_by_top(names: Iterator[str] | Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        top = name.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return counts


def _dcp_tensors(folder: str, meta: Any) -> dict[str, Any]:
    """Every tensor of a DCP folder, read by torch's own DCP reader without a process group, as
    the nested dict that was saved (``{"model": {...}, "optimizer": {...}}``). Pickled objects
    are not read: weights never need them."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader  # type: ignore[attr-defined]  # exported
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return meta  # already read, by the restricted unpickler

    flat = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in meta.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    try:
        _load_state_dict(flat, storage_reader=Reader(folder), planner=DefaultLoadPlanner(flatten_state_dict=False),
                         no_dist=True)  # fmt: skip
    except CheckpointFormatError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise CheckpointFormatError(f"{folder}: torch's DCP reader failed ({type(err).__name__}: {first})") from err
    # Nest the flattened names back as they were saved (DCP's planner_data keeps each one's path).
    paths = meta.planner_data if isinstance(getattr(meta, "planner_data", None), dict) else {}
    tree: dict[str, Any] = {}
    for name, tensor in flat.items():
        parts = [str(p) for p in paths.get(name, (name,))]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                node = tree
                parts = [name]
                break
        node[parts[-1]] = tensor
    return tree
