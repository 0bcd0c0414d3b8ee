"""A Hugging Face ``save_pretrained`` folder, or an Accelerate ``save_state`` folder.

The folder holds one model file (``model.safetensors[.index.json]`` or
``pytorch_model.bin[.index.json]``), opened by that file's own layout; Accelerate adds
``optimizer.bin``, ``scheduler.bin``, ``random_states_*.pkl`` and the like beside it, which are
listed as extras. `HuggingFaceFolder.verify` checks every file of the folder
(`ckptools.layouts.folder_check`), and names those no checksum covers.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointFormatError, CheckpointLayoutError
from ..storage import Location
from ..view import CheckpointView, Verification
from .base import Layout, Transform
from .folder_check import check_folder
from .frameworks import is_accelerate_folder, is_trainer_folder
from .sharded import rename_in_folder, weights_layout

# What Accelerator.save_state writes beside the model (accelerate/utils/constants.py).
_ACCELERATE_EXTRAS = {
    "optimizer*.bin": "optimizer state",
    "scheduler*.bin": "LR scheduler state",
    "sampler*.bin": "sampler state",
    "dl_state_dict*.bin": "DataLoader state",
    "scaler.pt": "GradScaler state",
    "random_states_*.pkl": "RNG states (a pickle; not read)",
    "custom_checkpoint_*.pkl": "custom object state (a pickle; not read)",
}
MODEL_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass
class _Opened:
    inner: CheckpointView
    model_files: set[str]  # relative to the folder: what the inner view checks itself


def model_file(folder: str, names: set[str] | list[str]) -> str:
    """The model file of a Hugging Face or Accelerate folder, or `CheckpointLayoutError` saying none is there."""
    model = next((n for n in MODEL_FILES if n in names), None)
    if model is None:
        found = ", ".join(sorted(names)[:12]) or "nothing"
        raise CheckpointLayoutError(
            f"{folder} is a folder but not a checkpoint layout ckptools reads: it holds no .metadata (DCP) and none "
            f"of {', '.join(MODEL_FILES)} (it holds {found}); pass the checkpoint file inside it"
        )
    return model


class HuggingFaceFolder(Layout):
    """A local folder holding a model file (and, for Accelerate, the training state beside it)."""

    name = "Hugging Face folder"
    folder = True

    def open(self, location: Location, *, trust_code: bool) -> CheckpointView:
        folder = location.path.rstrip("/") or "/"
        names = set(os.listdir(folder))
        if not any(n in names for n in MODEL_FILES) and (
            is_trainer_folder(folder, names) or is_accelerate_folder(names)
        ):
            # A Trainer's checkpoint-N/ or a save_state folder a kill cut short before its model file: not whole,
            # not of another kind
            problem = check_folder(folder, verify=False).problem
            if problem is not None:
                raise CheckpointFormatError(f"{folder}: {problem}; the folder is not a whole checkpoint")
        model = model_file(folder, names)
        extras = {n: what for n in sorted(names) for pat, what in _ACCELERATE_EXTRAS.items() if fnmatch.fnmatch(n, pat)}
        inner_loc = location.absolute.child(model)
        view = weights_layout(model).open(inner_loc, trust_code=trust_code)
        if extras:
            kind = "Accelerate save_state folder"
        elif "config.json" in names:
            kind = "Hugging Face folder"
        else:  # accelerator.save_model's, or a save_pretrained / save_state cut short: say what it is not
            kind = "folder of bare weights (no config.json for from_pretrained, no training state to resume)"
        for other in (n for n in MODEL_FILES if n in names and n != model):  # say which one was read
            extras[other] = f"also a model file; {model} was read"
        for n in sorted(names):  # Accelerate's further models: model_1.safetensors, pytorch_model_1.bin
            if re.fullmatch(r"(model|pytorch_model)_\d+\.(safetensors|bin)", n):
                extras[n] = "another model's weights (read it by passing the file)"
        model_files = {os.path.relpath(f, folder) for f in view.files} | {model}
        return CheckpointView(
            path=folder, format=f"{kind}, {view.format}", tensors=view.tensors, entries=view.entries,
            metadata=view.metadata, files=view.files, extras=extras, skipped=view.skipped, file_bytes=view.file_bytes,
            layout=self, location=location, trust_code=trust_code, state=_Opened(view, model_files),
        )  # fmt: skip

    def weights(self, view: CheckpointView, key: str | None, map_location: Any) -> Mapping[str, Any]:
        return view.state.inner.weights(key, map_location=map_location)  # type: ignore[no-any-return]

    def verify(self, view: CheckpointView) -> Verification:
        """The model file(s) through their own layout, then every other file of the folder, the
        manifest and the Trainer's expected set (`ckptools.layouts.folder_check`, the judgement
        ``latest_complete_checkpoint`` makes too)."""
        opened: _Opened = view.state
        inner = opened.inner.verify()
        found = check_folder(view.path, skip=opened.model_files)
        if found.problem is not None:
            raise CheckpointFormatError(f"{view.path}: {found.problem}; the folder is not a whole checkpoint")
        not_checksummed = {n: why for n, why in inner.not_checksummed.items() if n not in found.checksummed}
        not_checksummed.update(found.not_checksummed)
        return Verification("; ".join([inner.said, *found.said]), not_checksummed)

    def rename(self, location: Location, dst: str, transform: Transform, *, key: str | None) -> int:
        """Each weight file renamed, the index rewritten, the other files copied (`rename_in_folder`)."""
        folder = location.path.rstrip("/") or "/"
        if key is not None:
            raise CheckpointLayoutError(
                f"{location.url} is a folder of bare weights: it has no entries, so key= does not apply"
            )
        return rename_in_folder(location.absolute, model_file(folder, os.listdir(folder)), dst, transform)


HUGGING_FACE_FOLDER = HuggingFaceFolder()
