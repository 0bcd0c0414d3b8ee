"""Renaming the weights of a checkpoint file or folder without decoding tensors (``ckpt strip-module``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from .errors import CheckpointLayoutError, UnsafeCheckpointError
from .storage import PathLike, _fspath, atomic_write

__all__ = ["rename_checkpoint", "rename_file", "rename_folder"]

Transform = Callable[[Mapping[str, Any]], Mapping[str, Any]]


def rename_checkpoint(src: PathLike, dst: PathLike, transform: Transform, *, key: str | None = None) -> int:
    """Rename the weights' keys of a checkpoint file or folder into ``dst``; return how many changed.

    What ``ckpt strip-module`` and ``ckpt add-module`` do: ``transform`` maps a state dict to the
    renamed one (`ckptools.strip_prefix`, `ckptools.add_prefix`, or your own). No
    tensor is decoded: a torch zip's ``data.pkl`` or a safetensors header is rewritten and the
    tensor bytes copied; every other entry (optimizer, epoch; even ones that need classes torch's
    safe loader refuses) is kept. A folder (Hugging Face or Accelerate, sharded or not) is written
    as a folder; ``dst`` may equal ``src`` (each file is replaced atomically). ``key`` names the
    entry of a torch file that holds the weights (dotted for nesting) when the usual names do not.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"module.w": torch.ones(1)}, "epoch": 2}, "/tmp/r.pt")
        >>> ck.rename_checkpoint("/tmp/r.pt", "/tmp/r2.pt", ck.strip_prefix)
        1
    """
    src, dst = _fspath(src), _fspath(dst)
    if ("://" not in src and os.path.isdir(src)) or src.endswith(".json"):
        if key is not None:
            raise CheckpointLayoutError(f"{src} is a folder of bare weights: it has no entries, so key= does not apply")
        return rename_folder(src, dst, transform)
    return rename_file(src, dst, transform, key=key)


def rename_file(path: str, dst: str, transform: Transform, *, key: str | None = None) -> int:
    """Rename the weights of one checkpoint file into ``dst`` (may be ``path``); return how many changed.

    safetensors: only the header is rewritten. A local torch zip: only ``data.pkl`` is rewritten
    and every tensor record copied byte for byte; entries that need classes torch's safe loader
    refuses are kept as they were, never loaded (nothing runs). A legacy or remote file goes
    through torch's safe loader.
    """
    if path.endswith(".safetensors"):
        from .safetensors_file import rename_safetensors

        if key is not None:
            raise CheckpointLayoutError(
                f"{path} is a safetensors file of bare weights: it has no entries, so key= does not apply"
            )

        return rename_safetensors(path, dst, transform)
    from .convert import _local_zip

    if _local_zip(path):
        from .torchzip import TorchZip, dumps, loads, locate_weights

        archive = TorchZip(path)
        data = archive.read_pickle()
        try:
            tree = loads(data, path, archive)
        except UnsafeCheckpointError as refusal:
            from .reading import _lenient_tree

            tree, _ = _lenient_tree(data, path, refusal, archive)  # other entries are written back as they were read
        tree, weights, renamed = _rename_in_tree(tree, locate_weights(tree, key=key, path=path), transform)
        payload = dumps(tree)
        atomic_write(dst, lambda f: archive.write_with_pickle(f, payload))
    else:  # legacy (pre-1.6) format or a remote URL: through torch
        from .checkpoint import locate_weights as locate_loaded
        from .convert import load_torch
        from .serialization import save_file

        ckpt = load_torch(path)
        ckpt, weights, renamed = _rename_in_tree(ckpt, locate_loaded(ckpt, key=key, path=path), transform)
        save_file(dst, ckpt)
    return sum(1 for a, b in zip(weights, renamed) if a != b)


def _rename_in_tree(tree: Any, located: tuple[Any, Any, Any], transform: Transform) -> tuple[Any, Any, Any]:
    """Put the renamed weights where ``located`` (parent, key, weights) found them; return the
    tree (the renamed weights themselves when the tree was a bare state dict), old and new."""
    parent, key, weights = located
    renamed = transform(weights)
    if parent is None:
        return renamed, weights, renamed
    parent[key] = renamed
    return tree, weights, renamed


def rename_folder(path: str, dst: str, transform: Transform) -> int:
    """Rename the weights of a Hugging Face / Accelerate folder (or a sharded index's folder).

    Each weight file is renamed as by `rename_file`, the index's ``weight_map`` rewritten
    (last, so an interrupted run leaves the old index naming the old shards), and, when ``dst``
    is another folder, every other file (``config.json``, tokenizer, optimizer state) copied.

    Raises:
        CheckpointLayoutError: a DCP folder, or a folder holding no model file.
    """
    from .reading import _MODEL_FILES, _read_index

    folder = os.path.dirname(path) if path.endswith(".json") else path.rstrip("/")
    names = sorted(os.listdir(folder))
    if ".metadata" in names:
        raise CheckpointLayoutError(
            f"{folder} is a DCP folder, whose names live in a pickled .metadata; convert it instead "
            f"(ckpt convert {folder} OUT.safetensors strips 'module.' by default)"
        )
    model = os.path.basename(path) if path.endswith(".json") else next((n for n in _MODEL_FILES if n in names), None)
    if model is None:
        raise CheckpointLayoutError(f"{folder} holds none of {', '.join(_MODEL_FILES)}; pass the checkpoint file")
    os.makedirs(dst, exist_ok=True)
    same = os.path.realpath(dst) == os.path.realpath(folder)
    changed = 0
    if model.endswith(".json"):
        weight_map, metadata = _read_index(os.path.join(folder, model))
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            changed += rename_file(os.path.join(folder, shard), os.path.join(dst, shard), transform)
        renamed = transform({name: name for name in weight_map})
        if len(renamed) != len(weight_map):
            raise CheckpointLayoutError(f"{path}: renaming would give two tensors the same name; nothing was written")
        index = {"metadata": metadata, "weight_map": {new: weight_map[old] for new, old in renamed.items()}}
        payload = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        weight_files = {model, *shards}
    else:
        changed += rename_file(os.path.join(folder, model), os.path.join(dst, model), transform)
        weight_files = {model}
    if not same:
        for name in names:
            source = os.path.join(folder, name)
            if name not in weight_files and os.path.isfile(source):
                shutil.copy2(source, os.path.join(dst, name))
    if model.endswith(".json"):
        atomic_write(os.path.join(dst, model), lambda f: f.write(payload))
    return changed
