"""A sharded checkpoint: transformers' ``*.index.json`` (a ``weight_map``) and the shards it names.

The shards are safetensors or torch files, each opened by its own layout; weights are read one
shard at a time. `rename_in_folder` renames the weights of every shard and rewrites the index
last, for this layout and for the folders that hold one (``layouts.hf_folder``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..codecs.trees import locate_weights
from ..errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError
from ..storage import Location, atomic_write, open_for_read
from ..text import plural
from ..view import CheckpointView, Verification
from .base import Layout, Transform
from .named import file_layout
from .safetensors_file import SAFETENSORS_FILE


@dataclass
class _Opened:
    weight_map: dict[str, str]
    shards: list[str]
    views: dict[str, CheckpointView]
    folder: Location
    kind: str


class ShardedIndex(Layout):
    """An index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) and its shards."""

    name = "sharded checkpoint index"
    folder = True

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        index_path = location.url
        if not location.fs.exists(location.path):
            raise CheckpointNotFoundError(f"{index_path} does not exist")
        weight_map, metadata = read_index(location)
        folder = location.parent
        shards = sorted(set(weight_map.values()))
        views: dict[str, CheckpointView] = {}
        for shard in shards:
            shard_loc = folder.child(shard)
            if not shard_loc.fs.exists(shard_loc.path):
                raise CheckpointFormatError(
                    f"{index_path} names shard {shard}, which is missing from {folder} (an incomplete copy or download)"
                )
            views[shard] = file_layout(shard).open(shard_loc, trust_code=trust_code)
            for t in views[shard].tensors:
                t.file = shard
        tensors = [t for shard in shards for t in views[shard].tensors]
        kind = "safetensors" if all(file_layout(s) is SAFETENSORS_FILE for s in shards) else "torch"
        sizes = [v.file_bytes or 0 for v in views.values()]
        return CheckpointView(
            path=index_path, format=f"sharded {kind} ({len(shards)} shards)", tensors=tensors, metadata=metadata,
            files=[index_path, *(folder.child(s).url for s in shards)], file_bytes=sum(sizes), layout=self,
            location=location, trust_code=trust_code, state=_Opened(weight_map, shards, views, folder, kind),
        )  # fmt: skip

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        opened: _Opened = view.state
        if key is not None:
            return locate_weights({}, key=key, path=view.path)[2]
        where = {n: opened.views[s] for n, s in opened.weight_map.items()}
        for shard in opened.shards:  # names ckptools stored once (tied), listed in a shard's metadata only
            held = opened.views[shard].tensors
            where.update({t.name: opened.views[shard] for t in held if t.shared and t.name not in where})
        # Shard by shard, each in its own stored order (an index's weight_map is sorted by name,
        # which would put lm_head before the embedding it is tied to).
        order = [t.name for shard in opened.shards for t in opened.views[shard].tensors if t.name in where]
        order += [n for n in where if n not in set(order)]
        return _ShardedWeights(where, map_location, list(dict.fromkeys(order)))

    def verify(self, view: CheckpointView) -> Verification:
        opened: _Opened = view.state
        assert view.location is not None  # every view a layout opens has one
        problems = _index_problems(view.path, opened.weight_map, opened.views, opened.folder)
        if problems:
            raise CheckpointFormatError(f"{view.path}: " + "; ".join(problems))
        found = [opened.views[s].verify() for s in opened.shards]
        checked = sum(1 for v in found if v.checksummed)
        shards = len(opened.shards)
        said = (
            f"sharded {opened.kind}, {plural(shards, 'shard')}, {plural(len(opened.weight_map), 'tensor')}; "
            "the index and the shards agree"
        )
        if checked:
            said += f"; {checked} of {shards} shards carry checksums and match"
        return Verification(said, {name: why for v in found for name, why in v.not_checksummed.items()})

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        if key is not None:
            raise CheckpointLayoutError(
                f"{location.url} is a folder of bare weights: it has no entries, so key= does not apply"
            )
        return rename_in_folder(location.absolute.parent, location.name, dst, transform)


def weights_layout(name: str) -> Layout:
    """The layout of a file a folder names as its weights, by its name: an index (``.json``), a
    ``.safetensors`` file or a torch file (`ckptools.layouts.named.file_layout`)."""
    return SHARDED_INDEX if name.endswith(".json") else file_layout(name)


SHARDED_INDEX = ShardedIndex()


def read_index(path: Location) -> tuple[dict[str, str], dict[str, Any]]:
    handle, _ = open_for_read(path)
    try:
        with handle:
            raw = handle.read()
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointFormatError(f"{path} is not valid JSON ({err}); a sharded checkpoint's index is") from err
    if not isinstance(index, dict) or "weight_map" not in index:
        raise CheckpointLayoutError(
            f"{path} is a JSON file but not a sharded checkpoint's index (it has no 'weight_map'); pass the "
            "checkpoint file or the folder that holds it"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and "\\" not in v and v not in (".", "..")
        for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f"{path}: 'weight_map' must map tensor names to shard file names in the same folder (corrupt index)"
        )
    metadata = index.get("metadata")
    return weight_map, dict(metadata) if isinstance(metadata, dict) else {}


def _shard_pattern(shards: list[str]) -> str | None:
    """The glob transformers' shard names follow (``model-00001-of-00003.safetensors``), if they do."""
    match = re.fullmatch(r"(.+)-\d{5}-of-(\d{5})(\.\w+)", shards[0]) if shards else None
    return f"{match.group(1)}-?????-of-?????{match.group(3)}" if match else None


def _index_problems(
    index_path: str, weight_map: dict[str, str], views: dict[str, CheckpointView], folder: Location
) -> list[str]:
    problems = []
    for shard, view in views.items():
        # Every name a torch shard holds is an entry (tied ones share a storage); in a safetensors
        # shard a "shared" name is only an alias in ckptools' metadata, which no index lists.
        metadata_only = view.layout is SAFETENSORS_FILE
        held = {t.name for t in view.tensors if not (metadata_only and t.shared)}
        listed = {n for n, s in weight_map.items() if s == shard}
        if listed - held:
            problems.append(f"{len(listed - held)} tensors the index puts in {shard} are not there "
                            f"({', '.join(sorted(listed - held)[:5])})")  # fmt: skip
        stray = held - set(weight_map)
        if stray:
            problems.append(
                f"{shard} holds {len(stray)} tensors the index does not list ({', '.join(sorted(stray)[:5])})"
            )
        elsewhere = {n for n in held & set(weight_map) if weight_map[n] != shard}
        if elsewhere:
            problems.append(
                f"{shard} also holds {', '.join(sorted(elsewhere)[:5])}, which the index puts in another shard"
            )
    pattern = _shard_pattern(sorted(views))
    if pattern is not None:
        present = {os.path.basename(p) for p in folder.fs.glob(folder.child(pattern).path)}
        stray_files = sorted(present - set(views))
        if stray_files:
            problems.append(f"stray shard files the index does not name: {', '.join(stray_files[:5])}")
    return problems


class _ShardedWeights(Mapping[str, Any]):
    """Weights of a sharded checkpoint, read one shard at a time (the last shard read is kept)."""

    def __init__(self, where: dict[str, CheckpointView], map_location: Any, order: list[str]) -> None:
        self._where = where
        self._order = order
        self._location = map_location
        self._shard: tuple[str, Mapping[str, Any]] | None = None

    def __getitem__(self, name: str) -> Any:
        view = self._where[name]
        if self._shard is None or self._shard[0] != view.path:
            self._shard = (view.path, view.weights(map_location=self._location))
        try:
            return self._shard[1][name]
        except KeyError:
            raise CheckpointFormatError(
                f"{view.path} does not hold {name!r}, which the index puts there (run ckpt verify on the folder)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)  # shard by shard: iterating reads each shard once

    def __len__(self) -> int:
        return len(self._where)


def rename_in_folder(place: Location, model: str, dst: str, transform: Transform) -> int:
    """Rename the weights of the model file ``model`` (a weights file or an index) of ``folder`` into
    the folder ``dst``; return how many names changed.

    Each weight file is renamed by its own layout, the index's ``weight_map`` rewritten (last, so
    an interrupted run leaves the old index naming the old shards), and, when ``dst`` is another
    folder, every other file (``config.json``, tokenizer, optimizer state) copied.
    """
    folder = place.path.rstrip("/") or "/"
    names = sorted(os.listdir(folder))
    os.makedirs(dst, exist_ok=True)
    same = os.path.realpath(dst) == os.path.realpath(folder)
    changed = 0
    if weights_layout(model) is SHARDED_INDEX:
        index_path = place.child(model).url
        weight_map, metadata = read_index(place.child(model))
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            changed += file_layout(shard).rename(place.child(shard), os.path.join(dst, shard), transform, key=None)
        renamed = transform({name: name for name in weight_map})
        if len(renamed) != len(weight_map):
            raise CheckpointLayoutError(
                f"{index_path}: renaming would give two tensors the same name; nothing was written"
            )
        index = {"metadata": metadata, "weight_map": {new: weight_map[old] for new, old in renamed.items()}}
        payload = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        weight_files = {model, *shards}
    else:
        changed += file_layout(model).rename(place.child(model), os.path.join(dst, model), transform, key=None)
        weight_files = {model}
    if not same:
        for name in names:
            source = os.path.join(folder, name)
            if name not in weight_files and os.path.isfile(source):
                shutil.copy2(source, os.path.join(dst, name))
    if weights_layout(model) is SHARDED_INDEX:
        atomic_write(os.path.join(dst, model), lambda f: f.write(payload))
    return changed
