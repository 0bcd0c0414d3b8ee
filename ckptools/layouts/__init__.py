"""Checkpoint layouts, one module each, and the one place that decides which layout a path is.

========================  ====================================================================
layout (module)           recognised by (`detect`)
========================  ====================================================================
torch file (torch_file)   any other file: ``torch.save``'s zip (since 1.6: .pt/.pth/.bin/.ckpt,
                          starting ``PK``) or its legacy (pre-1.6) format
safetensors file          a ``.safetensors`` file
sharded index (sharded)   a ``*.json`` file: transformers' ``model.safetensors.index.json`` /
                          ``pytorch_model.bin.index.json`` (a ``weight_map``)
Hugging Face folder       a local folder holding ``model.safetensors[.index.json]`` or
(hf_folder)               ``pytorch_model.bin[.index.json]`` (``save_pretrained``); with
                          ``optimizer.bin`` and the like beside it, an Accelerate ``save_state`` folder
DCP folder (dcp)          a local folder holding ``.metadata``, that ``.metadata`` file, or one of
                          its ``.distcp`` files (refused, naming the folder to pass)
========================  ====================================================================

Each layout implements `ckptools.layouts.base.Layout` (the order of its calls is documented
there). A new layout is one module here with one `Layout` subclass, and one line in `detect`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# What a checkpoint holds, named for the operations (which import no codec): ckptools' own
# metadata entry and its reader, Lightning's version entry.
from ..codecs.record import META_KEY, Record, record_of
from ..codecs.trees import LIGHTNING_VERSION_KEY
from ..errors import weights_only_switch
from ..storage import Location, PathLike, resolve
from ..view import CheckpointView, TensorInfo
from .base import Layout, Transform
from .dcp import DCP_FOLDER
from .export import Planned, safetensors_plan
from .folder_check import MANIFEST, check_folder, files_whole, write_manifest
from .frameworks import (
    ACCELERATE,
    ACCELERATE_GRADIENTS,
    LIGHTNING,
    MANAGER_RESUMES,
    TRAINER,
    TRAINER_FOLDERS,
    AccelerateLayout,
    Framework,
    accelerate_file,
    accelerate_pattern,
    all_frameworks,
    framework_of,
    is_trainer_folder,
)
from .hf_folder import HUGGING_FACE_FOLDER, MODEL_FILES
from .named import writer_for
from .safetensors_file import SAFETENSORS_FILE
from .sharded import weights_layout
from .torch_file import TORCH_FILE, zip_records
from .torch_io import check_records, damaged_record, load_file, verify_torch_file

__all__ = [
    "ACCELERATE",
    "ACCELERATE_GRADIENTS",
    "LIGHTNING",
    "LIGHTNING_VERSION_KEY",
    "MANAGER_RESUMES",
    "MANIFEST",
    "META_KEY",
    "SAFETENSORS_FILE",
    "TORCH_FILE",
    "TRAINER",
    "TRAINER_FOLDERS",
    "AccelerateLayout",
    "CheckpointView",
    "Framework",
    "Layout",
    "Planned",
    "Record",
    "TensorInfo",
    "Transform",
    "accelerate_file",
    "accelerate_pattern",
    "all_frameworks",
    "check_folder",
    "check_records",
    "damaged_record",
    "detect",
    "files_whole",
    "framework_of",
    "is_checkpoint_folder",
    "is_lightning_checkpoint",
    "load_file",
    "open_checkpoint",
    "open_location",
    "plan_safetensors",
    "read_checkpoint",
    "read_weights",
    "record_of",
    "verify_torch_file",
    "write_manifest",
    "writer_for",
    "zip_records",
]


def detect(location: Location) -> Layout:
    """The layout of ``location``: the one place ckptools decides what a path is.

    Decided from the name and, for a local folder, its listing; no file is opened (a file that
    turns out to be something else is named as such when its layout opens it).

    Examples:
        >>> from ckptools.storage import resolve
        >>> detect(resolve("model.safetensors")).name, detect(resolve("s3://b/step-5.pt")).name
        ('safetensors file', 'torch file')
    """
    name = location.name
    if location.local and os.path.isdir(location.path):
        return DCP_FOLDER if os.path.exists(os.path.join(location.path, ".metadata")) else HUGGING_FACE_FOLDER
    if (name == ".metadata" and location.local) or name.endswith(".distcp"):
        return DCP_FOLDER
    return weights_layout(name)


def is_checkpoint_folder(location: Location) -> bool:
    """Whether ``location`` is a local folder that a layout reads as one checkpoint (a DCP folder, a
    Hugging Face or Accelerate folder, an HF Trainer's ``checkpoint-N/``), from its listing alone: the
    question a reader of run folders asks first (`ckptools.cli.runs.run_folder`).

    Examples:
        >>> import tempfile
        >>> from ckptools.storage import resolve
        >>> is_checkpoint_folder(resolve(tempfile.mkdtemp()))  # an empty folder
        False
    """
    if not location.local or not os.path.isdir(location.path):
        return False
    names = set(os.listdir(location.path))
    return ".metadata" in names or bool(names & set(MODEL_FILES)) or is_trainer_folder(location.path, names)


def open_checkpoint(path: PathLike, *, weights_only: bool = True, trust_code: bool | None = None) -> CheckpointView:
    """Open a checkpoint file or folder of any layout ckptools reads (see `ckptools.layouts`).

    Args:
        path: a file, a folder, or an fsspec URL of a file.
        weights_only: keep torch's safe unpickler (the default): entries that need other classes are
            read as inert placeholders and only the weights are available. False lets torch unpickle
            every class the file names (runs code from the file: for files you trust only).
        trust_code: deprecated (goes in 0.6): ``trust_code=True`` is ``weights_only=False``.

    Raises:
        CheckpointNotFoundError: nothing there.
        CheckpointLayoutError: a valid file or folder of another kind (one shard of a DCP
            checkpoint, a folder holding no model file, a JSON file that is no index).
        CheckpointFormatError: damaged or not a checkpoint.
        UnsafeCheckpointError: the weights themselves need refused globals and ``weights_only`` is on.

    Examples:
        >>> import torch, ckptools as ck
        >>> torch.save({"model": {"w": torch.ones(2)}, "step": 3}, "/tmp/v.pt")
        >>> view = ck.open_checkpoint("/tmp/v.pt")
        >>> view.format, [t.name for t in view.tensors], view.entries["step"]
        ('torch zip', ['model.w'], '3')
    """
    weights_only = weights_only_switch(weights_only, trust_code, "ck.open_checkpoint")
    return open_location(resolve(path), weights_only=weights_only)


def open_location(location: Location, *, weights_only: bool = True) -> CheckpointView:
    """`open_checkpoint` of a resolved ``location``, the switch in its one spelling: what ckptools' own
    callers (``ckpt verify``) open a checkpoint with."""
    return detect(location).open(location, trust_code=not weights_only)


def read_weights(
    path: PathLike, *, key: str | None, map_location: Any, verify: bool = False, trust_code: bool = False
) -> Mapping[str, Any]:
    """The model weights of any layout, names as stored: what ``load_state_dict`` and ``load`` use.

    A single file is read directly (no view is built: a remote file is fetched once); ``verify``
    checks its checksums first. A folder or index is opened, and ``verify`` runs its whole check
    (every shard, index agreement) first.
    """
    location = resolve(path)
    return detect(location).read_weights(
        location, key=key, map_location=map_location, verify=verify, trust_code=trust_code
    )


def plan_safetensors(path: PathLike, *, key: str | None, transform: Transform, trust_code: bool) -> Planned:
    """The weights of any layout at ``path``, renamed by ``transform``, as safetensors to write
    (`ckptools.layouts.export.safetensors_plan`: a local torch zip's tensors are copied straight
    out of their records)."""
    location = resolve(path)
    return safetensors_plan(location, detect(location), key=key, transform=transform, trust_code=trust_code)


def read_checkpoint(
    location: Location, *, map_location: Any, trust_code: bool, verify: bool, placeholders: bool
) -> Any:
    """What `ckptools.load` restores from: a torch file's whole tree (`TorchFile.read_tree`, with
    ``placeholders`` for entries its safe loader refuses), or the bare weights of any other
    layout (a ``.safetensors`` file, a Hugging Face or Accelerate folder, a sharded index, a DCP
    folder: no code can run from these), which a model entry finds."""
    layout = detect(location)
    if layout is not TORCH_FILE:
        return dict(layout.read_weights(location, key=None, map_location=map_location, verify=verify))
    return TORCH_FILE.read_tree(
        location, map_location=map_location, trust_code=trust_code, verify=verify, placeholders=placeholders
    )


def is_lightning_checkpoint(location: Location) -> bool:
    """Whether ``location`` is a local Lightning checkpoint (see `TorchFile.is_lightning`)."""
    return detect(location) is TORCH_FILE and TORCH_FILE.is_lightning(location)
